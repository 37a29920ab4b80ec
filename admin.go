package caddyllm

import (
	"encoding/json"
	"fmt"
	"net/http"
	"time"

	"github.com/caddyserver/caddy/v2"
)

func init() {
	caddy.RegisterModule(adminAPI{})
}

// adminAPI serves the plugin's state on Caddy's admin listener:
//
//	GET    /llm/upstreams  every upstream's in-flight tokens and requests, saturation, last scraped
//	                       metrics and their age, and learned route count
//	DELETE /llm/upstreams  forget what was learned of every upstream with nothing in flight (its
//	                       service model, slot count, token scale, cache trust), as after replacing the
//	                       hardware behind an address; ?upstream=host:port only that one's (404 for an
//	                       address it keeps nothing of); routes are kept (DELETE /llm/routes)
//	GET    /llm/routes     learned route and conversation pin counts
//	DELETE /llm/routes     forget every learned route and pin (after redeploying a model, say)
type adminAPI struct{}

// CaddyModule returns the Caddy module information.
func (adminAPI) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "admin.api.llm",
		New: func() caddy.Module { return new(adminAPI) },
	}
}

// Routes returns the admin routes.
func (a adminAPI) Routes() []caddy.AdminRoute {
	return []caddy.AdminRoute{
		{Pattern: "/llm/upstreams", Handler: caddy.AdminHandlerFunc(a.upstreams)},
		{Pattern: "/llm/routes", Handler: caddy.AdminHandlerFunc(a.routes)},
	}
}

type routesReport struct {
	Routes      int    `json:"routes"`
	Pins        int    `json:"conversation_pins"`
	Evictions   uint64 `json:"evictions"`
	Expired     uint64 `json:"expired"`
	Upstreams   int    `json:"upstreams_known"`
	Provisioned bool   `json:"provisioned"` // false when no loaded config uses lb_policy llm
}

// currentRoutesReport adds up every route table in use (one per distinct table configuration).
func currentRoutesReport() routesReport {
	var rep routesReport
	for _, t := range allRoutes() {
		st := t.Stats()
		rep.Routes += st.Routes
		rep.Pins += st.Pins
		rep.Evictions += st.Evictions
		rep.Expired += st.Expired
		rep.Upstreams = max(rep.Upstreams, st.Upstreams)
		rep.Provisioned = true
	}
	return rep
}

// forgetReport is what DELETE /llm/upstreams did: how many upstreams it forgot, and how many it kept
// because they had requests in flight (ask again once they have ended).
type forgetReport struct {
	Forgotten int `json:"forgotten"`
	InFlight  int `json:"kept_in_flight"`
}

func (adminAPI) upstreams(w http.ResponseWriter, r *http.Request) error {
	var forgot *forgetReport
	switch r.Method {
	case http.MethodGet:
	case http.MethodDelete:
		dial := r.URL.Query().Get("upstream")
		forgot = new(forgetReport)
		forgot.Forgotten, forgot.InFlight = loads.forget(dial, time.Now().UnixNano())
		if dial != "" && forgot.Forgotten+forgot.InFlight == 0 {
			// A typo must not read as success: nothing was forgotten because nothing is known there.
			return caddy.APIError{HTTPStatus: http.StatusNotFound,
				Err: fmt.Errorf("upstream %q: no state kept for that address (GET /llm/upstreams lists the known ones, by their dial address host:port)", dial)}
		}
	default:
		return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed, Err: fmt.Errorf("method %s not allowed", r.Method)}
	}
	return writeJSON(w, struct {
		Forget    *forgetReport    `json:"forget,omitempty"`
		Upstreams []upstreamStatus `json:"upstreams"`
		Routes    routesReport     `json:"routes"`
	}{Forget: forgot, Upstreams: upstreamReport(true), Routes: currentRoutesReport()})
}

func (adminAPI) routes(w http.ResponseWriter, r *http.Request) error {
	switch r.Method {
	case http.MethodGet:
	case http.MethodDelete:
		for _, t := range allRoutes() {
			t.Clear()
		}
	default:
		return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed, Err: fmt.Errorf("method %s not allowed", r.Method)}
	}
	return writeJSON(w, currentRoutesReport())
}

func writeJSON(w http.ResponseWriter, v any) error {
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// Interface guards
var _ caddy.AdminRouter = (*adminAPI)(nil)

package caddyllm

import (
	"encoding/json"
	"fmt"
	"net/http"

	"github.com/caddyserver/caddy/v2"
)

func init() {
	caddy.RegisterModule(adminAPI{})
}

// adminAPI serves the plugin's state on Caddy's admin listener:
//
//	GET    /llm/upstreams  every upstream's in-flight tokens and requests, saturation, last scraped
//	                       metrics and their age, and learned route count
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

func currentRoutesReport() routesReport {
	t := currentRoutes()
	if t == nil {
		return routesReport{}
	}
	st := t.Stats()
	return routesReport{Routes: st.Routes, Pins: st.Pins, Evictions: st.Evictions, Expired: st.Expired, Upstreams: st.Upstreams, Provisioned: true}
}

func (adminAPI) upstreams(w http.ResponseWriter, r *http.Request) error {
	if r.Method != http.MethodGet {
		return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed, Err: fmt.Errorf("method %s not allowed", r.Method)}
	}
	return writeJSON(w, struct {
		Upstreams []upstreamStatus `json:"upstreams"`
		Routes    routesReport     `json:"routes"`
	}{Upstreams: upstreamReport(true), Routes: currentRoutesReport()})
}

func (adminAPI) routes(w http.ResponseWriter, r *http.Request) error {
	switch r.Method {
	case http.MethodGet:
	case http.MethodDelete:
		if t := currentRoutes(); t != nil {
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

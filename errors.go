package caddyllm

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/dustin/go-humanize"
)

func init() {
	caddy.RegisterModule(LLMErrors{})
	httpcaddyfile.RegisterHandlerDirective("llm_errors", parseLLMErrors)
	// First in a site, so that it sees the errors of every matcher after it.
	httpcaddyfile.RegisterDirectiveOrder("llm_errors", httpcaddyfile.Before, "tracing")
}

// requestError is why the llm matcher cannot route an LLM request: a body it cannot read (400), one over
// its cap (413) or an encoding it does not read (415). Its message says what to change; it is what
// {err.message} holds in handle_errors, and what llm_errors sends as an OpenAI-style error.
type requestError struct {
	status  int
	code    string // an OpenAI-style error code
	message string
	err     error
}

func (e *requestError) Error() string { return e.message }
func (e *requestError) Unwrap() error { return e.err }

// matcherError turns a body or parse error of the matcher, whose body cap is maxBody, into the error
// the client should see.
func matcherError(err error, maxBody int64) error {
	var maxBytes *http.MaxBytesError
	re := &requestError{status: http.StatusBadRequest, code: "invalid_request_body", message: err.Error(), err: err}
	switch {
	case errors.Is(err, errBodyTooLarge):
		re.status, re.code = http.StatusRequestEntityTooLarge, "request_too_large"
		re.message = fmt.Sprintf("request body too large: over the %s limit of the llm matcher "+
			"(max_body_size in the Caddyfile, max_body_bytes in JSON)", humanize.IBytes(uint64(maxBody)))
	case errors.As(err, &maxBytes):
		re.status, re.code = http.StatusRequestEntityTooLarge, "request_too_large"
		re.message = fmt.Sprintf("request body too large: over the %s limit of request_body max_size", humanize.IBytes(uint64(maxBytes.Limit)))
	case errors.Is(err, errUnsupportedEncoding):
		re.status, re.code = http.StatusUnsupportedMediaType, "unsupported_content_encoding"
	}
	return caddyhttp.Error(re.status, re)
}

// LLMErrors answers errors as OpenAI-style JSON errors, the form OpenAI clients read and show:
//
//	{"error": {"message": "...", "type": "invalid_request_error", "param": null, "code": "request_too_large"}}
//
// Caddy answers a handler's or matcher's error with its status and an empty body unless handle_errors
// says otherwise, and a matcher cannot write a body. Placed in a site (the Caddyfile directive
// llm_errors orders itself first), LLMErrors answers the errors of the llm matchers after it - a body
// they cannot read, over their cap, or in an encoding they do not read - and passes every other error
// on to Caddy's error handling unchanged. Placed in handle_errors, it answers every error in that form;
// errors other than the llm matcher's say only their status text, so upstream addresses and other
// internals stay out of responses.
type LLMErrors struct{}

// CaddyModule returns the Caddy module information.
func (LLMErrors) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.llm_errors",
		New: func() caddy.Module { return new(LLMErrors) },
	}
}

// ServeHTTP runs next and answers the llm matcher's errors, or, in handle_errors, the error handled.
func (LLMErrors) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	if handled, ok := r.Context().Value(caddyhttp.ErrorCtxKey).(error); ok {
		writeOpenAIError(w, handled)
		return nil
	}
	err := next.ServeHTTP(w, r)
	var re *requestError
	if err != nil && errors.As(err, &re) {
		writeOpenAIError(w, err)
		return nil
	}
	return err
}

// openAIError is the body OpenAI's API answers errors with.
type openAIError struct {
	Error struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Param   *string `json:"param"`
		Code    *string `json:"code"`
	} `json:"error"`
}

// writeOpenAIError writes err as an OpenAI-style error with err's status (500 when it has none).
func writeOpenAIError(w http.ResponseWriter, err error) {
	status := http.StatusInternalServerError
	var he caddyhttp.HandlerError
	if errors.As(err, &he) && he.StatusCode != 0 {
		status = he.StatusCode
	}
	var body openAIError
	body.Error.Message = http.StatusText(status)
	body.Error.Type = "invalid_request_error"
	if status >= 500 {
		body.Error.Type = "server_error"
	}
	var re *requestError
	if errors.As(err, &re) {
		body.Error.Message, body.Error.Code = re.message, &re.code
	}
	out, _ := json.Marshal(body)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Del("Content-Length")
	w.WriteHeader(status)
	_, _ = w.Write(out)
}

// Interface guards
var _ caddyhttp.MiddlewareHandler = (*LLMErrors)(nil)

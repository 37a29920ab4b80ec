package vllmsim

import (
	"slices"
	"strings"
)

// loraSlot is one GPU adapter slot (guarded by Server.mu).
type loraSlot struct {
	adapter  string
	refs     int   // running requests using it; it may be evicted only at 0
	lastUsed int64 // engine step at which its last running request left
}

// loraSlotLocked returns the index of adapter's slot, or -1.
func (s *Server) loraSlotLocked(adapter string) int {
	for i := range s.loras {
		if s.loras[i].adapter == adapter {
			return i
		}
	}
	return -1
}

// loraAdmissibleLocked reports whether r's adapter is resident or can be loaded now: a slot is free, or
// holds an adapter no running request uses.
func (s *Server) loraAdmissibleLocked(r *request) bool {
	if r.adapter == "" || len(s.loras) < s.cfg.MaxLoRAs || s.loraSlotLocked(r.adapter) >= 0 {
		return true
	}
	for i := range s.loras {
		if s.loras[i].refs == 0 {
			return true
		}
	}
	return false
}

// takeLoRALocked gives the admitted request r its adapter's slot, loading the adapter (into a free slot,
// else in place of the least recently used idle one) when it is not resident. It returns whether a
// load happened; the caller made sure loraAdmissibleLocked(r).
func (s *Server) takeLoRALocked(r *request) (loaded bool) {
	if r.adapter == "" {
		return false
	}
	r.loraHeld = true
	if i := s.loraSlotLocked(r.adapter); i >= 0 {
		s.loras[i].refs++
		return false
	}
	s.loraLoads++
	if len(s.loras) < s.cfg.MaxLoRAs {
		s.loras = append(s.loras, loraSlot{adapter: r.adapter, refs: 1})
		return true
	}
	lru := -1
	for i := range s.loras {
		if s.loras[i].refs == 0 && (lru < 0 || s.loras[i].lastUsed < s.loras[lru].lastUsed) {
			lru = i
		}
	}
	s.loras[lru] = loraSlot{adapter: r.adapter, refs: 1}
	return true
}

// releaseLoRALocked drops r's use of its adapter's slot when it leaves the running batch; idempotent.
func (s *Server) releaseLoRALocked(r *request) {
	if !r.loraHeld {
		return
	}
	r.loraHeld = false
	if i := s.loraSlotLocked(r.adapter); i >= 0 {
		s.loras[i].refs--
		s.loras[i].lastUsed = s.steps
	}
}

// ResidentLoRAs returns the adapters in the GPU slots, sorted (whether or not a request uses them).
func (s *Server) ResidentLoRAs() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	names := make([]string, len(s.loras))
	for i := range s.loras {
		names[i] = s.loras[i].adapter
	}
	slices.Sort(names)
	return names
}

// loraListsLocked returns the adapters of the running and of the waiting requests, as vLLM reports them
// in vllm:lora_requests_info: sorted, distinct, comma-separated. It costs O(running + waiting).
func (s *Server) loraListsLocked() (running, waiting string) {
	var run, wait []string
	for _, r := range s.running {
		if r.adapter != "" {
			run = append(run, r.adapter)
		}
	}
	for _, r := range s.waiting[s.waitHead:] {
		if r.adapter != "" && r.state == stateWaiting {
			wait = append(wait, r.adapter)
		}
	}
	join := func(l []string) string {
		slices.Sort(l)
		return strings.Join(slices.Compact(l), ",")
	}
	return join(run), join(wait)
}

// adapterFor returns the adapter a request for model runs with ("" for the base model) and whether the
// server serves model at all. An empty model is the base model.
func (s *Server) adapterFor(model string) (string, bool) {
	switch {
	case model == "" || model == s.cfg.Model:
		return "", true
	case slices.Contains(s.cfg.LoRAAdapters, model):
		return model, true
	}
	return "", false
}

package selection

import (
	"encoding/json"
	"errors"
	"math"
	"math/rand/v2"
	"testing"
)

// learned returns a model that has seen every kind of observation from a backend 3x slower than the
// prior, with 12 slots.
func learned(prior Service) *ServiceModel {
	rng := rand.New(rand.NewPCG(7, 7))
	b := backend{overhead: 0.09, perToken: 3 / 8000.0, tokenSeconds: 0.09}
	m := NewServiceModel(prior)
	for i := range 30 {
		uncached, output := 100+rng.IntN(4000), 32+rng.IntN(200)
		m.ObserveEnd(uncached, output, 0, b.duration(uncached, output, rng))
		batch := float64(4 + i%8)
		m.ObserveBusy(64*(b.tokenSeconds+batch*b.tokenSeconds/100)+float64(uncached)*b.perToken, float64(uncached), 64, 64*batch)
		if i%3 == 0 {
			firstToken(m, uncached, i/3, 0, b.ttft(uncached, rng))
		}
		m.ObserveQueue(12, 3, 0.4)
	}
	return m
}

// throughJSON returns st as persist stores and reads it back.
func throughJSON(t *testing.T, st ModelState) ModelState {
	t.Helper()
	js, err := json.Marshal(st)
	if err != nil {
		t.Fatal(err)
	}
	var back ModelState
	if err := json.Unmarshal(js, &back); err != nil {
		t.Fatal(err)
	}
	return back
}

// TestServiceModelStateRoundTrip: a model restored from a saved state (through JSON, as persist stores
// it) predicts what the saved one predicts, and goes on learning exactly as it does.
func TestServiceModelStateRoundTrip(t *testing.T) {
	saved := learned(Prior)
	firstToken(saved, 1000, 0, 5, 1) // came before its predicted wait ended: skipped
	st := throughJSON(t, saved.State())
	restored := NewServiceModel(Prior)
	fresh := restored.Service()
	if err := restored.Restore(st); err != nil {
		t.Fatalf("Restore: %v", err)
	}
	if got, want := restored.Service(), saved.Service(); got != want {
		t.Fatalf("restored service %+v, want %+v", got, want)
	}
	if got := restored.Service(); got.Slots != 12 || got.PrefillSecondsPerToken < 2*fresh.PrefillSecondsPerToken || got.Free == 0 || got.SkippedFirstTokens == 0 {
		t.Fatalf("restored service %+v: want 12 slots, about 3x the prior's prefill time, the requests it ran beside a first token and the first tokens skipped", got)
	}
	for _, m := range []*ServiceModel{saved, restored} {
		m.ObserveEnd(2000, 100, 0.1, 12)
		firstToken(m, 500, 0, 0, 0.3)
		m.ObserveBusy(3, 9000, 70, 700)
		m.ObserveQueue(13, 1, 0.2)
	}
	if got, want := restored.Service(), saved.Service(); got != want {
		t.Errorf("after the same observations: restored %+v, saved %+v", got, want)
	}
}

// TestServiceModelRestoresBusyWithoutBatch: a state saved before the busy intervals' fit had a time per
// sequence (no busy_batch) restores the step time and prefill it saved, with the prior's time per
// sequence, and is saved again with both.
func TestServiceModelRestoresBusyWithoutBatch(t *testing.T) {
	saved := learned(Prior)
	st := saved.State()
	st.BusyBatch = nil
	old := throughJSON(t, st)
	m := NewServiceModel(Prior)
	if err := m.Restore(old); err != nil {
		t.Fatalf("Restore: %v", err)
	}
	got := m.State()
	if got.Busy != st.Busy || got.BusyBatch == nil || got.BusyBatch.Theta[1] != Prior.TokenSeconds*seqShare*1000 {
		t.Errorf("restored busy fit %+v / %+v, want %+v and the prior's time per sequence", got.Busy, got.BusyBatch, st.Busy)
	}
	if a, b := m.Service().PrefillSecondsPerToken, saved.Service().PrefillSecondsPerToken; a != b {
		t.Errorf("restored prefill %v, want the saved %v", a, b)
	}
}

// TestServiceModelRestoreRefuses: a state learned from another prior (a changed capacity hint), or one no
// model can be in (a damaged or edited file), leaves the model as it was.
func TestServiceModelRestoreRefuses(t *testing.T) {
	good := learned(Prior).State()
	other := learned(Prior.Slower(2))
	m := NewServiceModel(Prior)
	before := m.Service()
	if err := m.Restore(other.State()); !errors.Is(err, ErrOtherPrior) {
		t.Errorf("state of another prior: err %v, want ErrOtherPrior", err)
	}
	bad := map[string]func(*ModelState){
		"NaN theta":          func(s *ModelState) { s.TTFT.Theta[1] = math.NaN() },
		"infinite variance":  func(s *ModelState) { s.Busy.P[0][0] = math.Inf(1) },
		"negative variance":  func(s *ModelState) { s.Busy.P[1][1] = -1 },
		"huge covariance":    func(s *ModelState) { s.TTFT.P[0][1] = 1e12 },
		"huge parameter":     func(s *ModelState) { s.Busy.Theta[0] = 1.7e308 },
		"negative count":     func(s *ModelState) { s.FirstToks = -1 },
		"negative skipped":   func(s *ModelState) { s.Skipped = -1 },
		"scale out of range": func(s *ModelState) { s.LogScale = 10 },
		"slots above ceil":   func(s *ModelState) { s.Slots, s.Ceiling = 64, 8 },
		"negative duration":  func(s *ModelState) { s.MeanDur = -2 },
		"NaN prior":          func(s *ModelState) { s.Prior.Overhead = math.NaN() },
		"NaN batch fit":      func(s *ModelState) { s.BusyBatch.Theta[1] = math.NaN() },
		"huge batch fit":     func(s *ModelState) { s.BusyBatch.Theta[2] = 1e300 },
		"batch variance":     func(s *ModelState) { s.BusyBatch.P[1][1] = -1 },
		"batch covariance":   func(s *ModelState) { s.BusyBatch.P[2][1] = math.Inf(-1) },
		"batch count":        func(s *ModelState) { s.BusyBatchN = -1 },
	}
	for name, damage := range bad {
		st := good
		batch := *good.BusyBatch
		st.BusyBatch = &batch
		damage(&st)
		if err := m.Restore(st); err == nil || errors.Is(err, ErrOtherPrior) {
			t.Errorf("%s: err %v, want a refusal", name, err)
		}
	}
	if got := m.Service(); got != before {
		t.Errorf("after refused restores the service is %+v, want the untouched %+v", got, before)
	}
}

// TestServiceModelCountsStayRestorable: a model whose observation counts reached the most Restore accepts
// keeps counting without passing it, so the state it saves is still restored.
func TestServiceModelCountsStayRestorable(t *testing.T) {
	st := learned(Prior).State()
	st.FirstToks, st.Durations, st.BusyN = maxStateCount, maxStateCount, maxStateCount
	m := NewServiceModel(Prior)
	if err := m.Restore(st); err != nil {
		t.Fatalf("Restore at the largest counts: %v", err)
	}
	m.ObserveEnd(2000, 100, 0.1, 12)
	firstToken(m, 500, 0, 0, 0.3)
	m.ObserveBusy(3, 9000, 70, 0)
	if err := NewServiceModel(Prior).Restore(m.State()); err != nil {
		t.Errorf("the state saved after more observations is refused: %v", err)
	}
}

// TestServiceModelRestoreRepairsCovariance: a stored covariance that is no covariance matrix (asymmetric,
// or indefinite as the per-entry clamp of versions before boundCovariance2 left a wound-up estimator:
// this one is that estimator's at its update 262) is restored as the nearest bounded one, not refused:
// refusing it would drop everything else the model had learned.
func TestServiceModelRestoreRepairsCovariance(t *testing.T) {
	for name, p := range map[string][2][2]float64{
		"asymmetric":    {{1, 0}, {1, 0.5}},
		"indefinite":    {{1, 2}, {2, 1}},
		"wound up":      {{1e6, -676059.6704468193}, {-676059.6704468193, 450706.46863210935}},
		"zero variance": {{0, 0}, {0, 3}},
	} {
		st := learned(Prior).State()
		st.TTFT.P = p
		m := NewServiceModel(Prior)
		if err := m.Restore(st); err != nil {
			t.Errorf("%s: Restore() = %v, want the state repaired", name, err)
			continue
		}
		got := m.State().TTFT.P
		if !isCovariance(got) {
			t.Errorf("%s: restored P = %v, want a covariance matrix", name, got)
		}
		if got[0][0] != max(p[0][0], minVariance) || got[1][1] != max(p[1][1], minVariance) {
			t.Errorf("%s: restored variances %v, %v, want the stored %v, %v", name, got[0][0], got[1][1], p[0][0], p[1][1])
		}
	}
}

// FuzzRestore: no stored state, however damaged, makes Restore panic, and a state it accepts gives a
// service whose figures are finite and non-negative, before and after more observations (after which the
// model's own state is still one Restore accepts): what a decision reads from a restored model is a
// number, and stays one.
func FuzzRestore(f *testing.F) {
	good, err := json.Marshal(learned(Prior).State())
	if err != nil {
		f.Fatal(err)
	}
	f.Add(good)
	f.Add([]byte(`{"prior":{"overhead":0.03,"prefill_seconds_per_token":0.000125,"token_seconds":0.03,"mean_duration":2},"busy":{"theta":[1.7e308,0],"p":[[0,0],[0,0]]},"busy_intervals":5}`))
	f.Add([]byte(`{"prior":{"overhead":0.03,"prefill_seconds_per_token":0.000125,"token_seconds":0.03,"mean_duration":2},"busy":{"theta":[1e300,-1e300],"p":[[1e6,-1e6],[-1e6,1e6]]},"busy_intervals":5}`))
	f.Add([]byte(`{"prior":{"overhead":0.03,"prefill_seconds_per_token":0.000125,"token_seconds":0.03,"mean_duration":2},"busy_batch":{"theta":[0.03,0.25,0.125],"p":[[1e6,1e6,-1e6],[1e6,1e6,1e6],[-1e6,1e6,1e6]]},"busy_intervals":5}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		var st ModelState
		if json.Unmarshal(data, &st) != nil {
			return
		}
		m := NewServiceModel(Prior)
		if m.Restore(st) != nil {
			return
		}
		check := func(when string) {
			s := m.Service()
			for _, v := range []float64{s.Overhead, s.PrefillSecondsPerToken, s.TokenSeconds, s.MeanDuration, s.Slots, s.Ceiling} {
				if math.IsNaN(v) || math.IsInf(v, 0) || v < 0 {
					t.Fatalf("%s: service %+v from state %+v", when, s, st)
				}
			}
			if err := m.State().check(); err != nil {
				t.Fatalf("%s: the model's own state is refused (%v): %+v, from %+v", when, err, m.State(), st)
			}
		}
		check("restored")
		m.ObserveEnd(2000, 100, 0.1, 3)
		firstToken(m, 500, 0, 0, 0.2)
		m.ObserveBusy(2, 4000, 70, 700)
		m.ObserveQueue(8, 2, 0.3)
		check("after observations")
	})
}

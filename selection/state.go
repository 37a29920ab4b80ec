package selection

import (
	"errors"
	"fmt"
	"math"
)

// ModelState is what a ServiceModel has learned, in a form that survives the process: the caller stores
// it (JSON) and gives it back to Restore after a restart, so the model starts from what it knew instead
// of from the prior. Its fields are the model's own, not a summary, so a restored model goes on learning
// exactly as the saved one would have.
type ModelState struct {
	// Prior is the prior the state was learned from; Restore refuses a state learned from another (a
	// changed capacity hint forgets what was learned, as SetPrior does).
	Prior StatePrior `json:"prior"`

	TTFT      RLSState `json:"ttft"`
	FirstToks int      `json:"first_tokens"`
	Skipped   int      `json:"skipped_first_tokens,omitempty"` // Service.SkippedFirstTokens; absent from states saved before it
	Busy      RLSState `json:"busy"`                           // BusyBatch's step time and prefill, for versions before it
	// BusyBatch is the busy intervals' whole fit, with the time a sequence adds to a step; absent from
	// states saved before it (Restore then takes Busy, and the prior's time per sequence).
	BusyBatch *RLS3State `json:"busy_batch,omitempty"`
	// BusyBatchN is how many busy intervals counted generated tokens (Service.SequenceSeconds is reported
	// from one on).
	BusyBatchN int     `json:"busy_batch_intervals,omitempty"`
	BusyN      int     `json:"busy_intervals"`
	LogScale   float64 `json:"log_scale"`
	Durations  int     `json:"durations"`
	MeanDur    float64 `json:"mean_duration"`
	Slots      float64 `json:"slots"`
	Ceiling    float64 `json:"ceiling"`
	AtCeil     int     `json:"at_ceiling"`
	BelowCeil  int     `json:"below_ceiling"`
	Free       int     `json:"free,omitempty"` // Service.Free; absent from states saved before it (0: unknown)
}

// StatePrior is the part of a Service a prior sets.
type StatePrior struct {
	Overhead               float64 `json:"overhead"`
	PrefillSecondsPerToken float64 `json:"prefill_seconds_per_token"`
	TokenSeconds           float64 `json:"token_seconds"`
	MeanDuration           float64 `json:"mean_duration"`
}

func priorOf(s Service) StatePrior {
	return StatePrior{s.Overhead, s.PrefillSecondsPerToken, s.TokenSeconds, s.MeanDuration}
}

// RLSState is one recursive least-squares fit: its parameters and their covariance.
type RLSState struct {
	Theta [2]float64    `json:"theta"`
	P     [2][2]float64 `json:"p"`
}

// RLS3State is a recursive least-squares fit of three slopes: its parameters and their covariance.
type RLS3State struct {
	Theta [3]float64    `json:"theta"`
	P     [3][3]float64 `json:"p"`
}

// busyIndex maps Busy's two parameters to BusyBatch's: the step time and the prefill.
var busyIndex = [2]int{0, 2}

// ErrOtherPrior is Restore's answer to a state learned from another prior than the model's.
var ErrOtherPrior = errors.New("learned from another prior (a capacity hint changed)")

// maxStateCount bounds the observation counts Restore accepts: more than any process would count before
// the counts stop mattering (every threshold that reads them is below 100).
const maxStateCount = 1 << 30

// maxTheta bounds the fitted parameters Restore accepts, and every update holds them to it: seconds (an
// overhead or an engine step) and seconds per 1000 tokens, none of which is near 10,000 on any backend;
// one far larger would overflow the next update's arithmetic and leave the fit not a number for good. An
// accepted state can still be far from any backend's (FuzzRestore: a step time of 7 s with a prefill
// variance 1000 times its own), and one update against it moved a parameter to -21,010, a state the
// model's next Restore would refuse.
const maxTheta = 1e4

// State returns what the model has learned.
func (m *ServiceModel) State() ModelState {
	m.mu.Lock()
	defer m.mu.Unlock()
	return ModelState{
		Prior:      priorOf(m.prior),
		TTFT:       RLSState{m.ttft.theta, m.ttft.p},
		FirstToks:  m.ttftN,
		Skipped:    m.skippedN,
		Busy:       m.busy.project(),
		BusyBatch:  &RLS3State{m.busy.theta, m.busy.p},
		BusyBatchN: m.busyGenN,
		BusyN:      m.busyN,
		LogScale:   m.logScale,
		Durations:  m.durN,
		MeanDur:    m.meanDur,
		Slots:      m.slots,
		Ceiling:    m.ceiling,
		AtCeil:     m.atCeil,
		BelowCeil:  m.belowCeil,
		Free:       m.free,
	}
}

// Learned reports whether the state holds anything beyond the prior: an observation, or a running count
// from the backend's metrics.
func (st ModelState) Learned() bool {
	return st.FirstToks+st.BusyN+st.Durations > 0 || st.Ceiling > 0
}

// Restore replaces what the model has learned with st, unless st was learned from another prior
// (ErrOtherPrior) or is not a state a model can be in (a number not finite, a count or covariance out of
// range, a scale beyond the model's bounds): then the model is left as it was. A stored state may be old
// or come from a damaged file; what Restore accepts, the model's own clamps keep plausible, and new
// observations move it as they would have moved the saved model.
func (m *ServiceModel) Restore(st ModelState) error {
	if err := st.check(); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if st.Prior != priorOf(m.prior) {
		return ErrOtherPrior
	}
	// A covariance that is not symmetric positive semi-definite is made one (boundCovariance2), not
	// refused: versions before the bound saved such matrices when their estimator wound up, and an
	// indefinite one turns a variance negative within a few updates.
	m.ttft, m.ttftN, m.skippedN = rls2{theta: st.TTFT.Theta, p: boundCovariance2(st.TTFT.P)}, st.FirstToks, st.Skipped
	if b := st.BusyBatch; b != nil {
		m.busy = rls3{theta: b.Theta, p: boundCovariance3(b.P)}
	} else {
		m.busy = m.busyFrom2(st.Busy)
	}
	m.busyN, m.busyGenN = st.BusyN, st.BusyBatchN
	m.logScale, m.durN, m.meanDur = st.LogScale, st.Durations, st.MeanDur
	m.slots, m.ceiling, m.atCeil, m.belowCeil, m.free = st.Slots, st.Ceiling, st.AtCeil, st.BelowCeil, st.Free
	return nil
}

func (st ModelState) check() error {
	finite := []float64{st.Prior.Overhead, st.Prior.PrefillSecondsPerToken, st.Prior.TokenSeconds, st.Prior.MeanDuration,
		st.LogScale, st.MeanDur, st.Slots, st.Ceiling}
	for _, r := range st.fits() {
		finite = append(finite, r.Theta[0], r.Theta[1], r.P[0][0], r.P[0][1], r.P[1][0], r.P[1][1])
	}
	for _, v := range finite {
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return fmt.Errorf("a figure is not finite: %v", v)
		}
	}
	for _, n := range []int{st.FirstToks, st.Skipped, st.BusyN, st.BusyBatchN, st.Durations, st.AtCeil, st.BelowCeil, st.Free} {
		if n < 0 || n > maxStateCount {
			return fmt.Errorf("count %d out of range", n)
		}
	}
	for _, r := range st.fits() {
		for i := range 2 {
			if math.Abs(r.Theta[i]) > maxTheta {
				return fmt.Errorf("parameter %v out of range", r.Theta[i])
			}
			for j := range 2 {
				if math.Abs(r.P[i][j]) > maxCovariance {
					return fmt.Errorf("covariance %v out of range", r.P[i][j])
				}
			}
			if r.P[i][i] < 0 {
				return fmt.Errorf("negative variance %v", r.P[i][i])
			}
		}
	}
	switch {
	case math.Abs(st.LogScale) > math.Log(maxScale)+1e-9:
		return fmt.Errorf("speed scale %v out of range", math.Exp(st.LogScale))
	case st.MeanDur < 0 || st.Slots < 0 || st.Ceiling < 0 || st.Slots > st.Ceiling:
		return fmt.Errorf("durations or slots out of range (mean duration %v, slots %v, ceiling %v)", st.MeanDur, st.Slots, st.Ceiling)
	}
	return nil
}

// fits returns the state's fits as two-parameter ones: TTFT, Busy, and BusyBatch's parameters pairwise
// (what check verifies of each holds for every pair: finite, in range, variances not negative).
func (st ModelState) fits() []RLSState {
	fits := []RLSState{st.TTFT, st.Busy}
	if b := st.BusyBatch; b != nil {
		for _, ij := range [3][2]int{{0, 1}, {0, 2}, {1, 2}} {
			i, j := ij[0], ij[1]
			fits = append(fits, RLSState{Theta: [2]float64{b.Theta[i], b.Theta[j]},
				P: [2][2]float64{{b.P[i][i], b.P[i][j]}, {b.P[j][i], b.P[j][j]}}})
		}
	}
	return fits
}

// project returns r's step time and prefill with their covariance: the two-parameter fit a version
// before the time per sequence reads.
func (r rls3) project() RLSState {
	var st RLSState
	for a, i := range busyIndex {
		st.Theta[a] = r.theta[i]
		for b, j := range busyIndex {
			st.P[a][b] = r.p[i][j]
		}
	}
	return st
}

// busyFrom2 is the busy fit restored from a state saved before the time per sequence: its step time
// and prefill as saved, and the prior's time per sequence. The caller holds m.mu.
func (m *ServiceModel) busyFrom2(st RLSState) rls3 {
	p2 := boundCovariance2(st.P)
	r := newBusyFit(m.prior)
	for a, i := range busyIndex {
		r.theta[i] = st.Theta[a]
		for b, j := range busyIndex {
			r.p[i][j] = p2[a][b]
		}
	}
	return r
}

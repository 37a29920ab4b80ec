package scraper

import (
	"slices"
	"strconv"
	"strings"

	dto "github.com/prometheus/client_model/go"
)

// LoRA is a target's LoRA adapter residency, from vLLM's info gauge
//
//	vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,b",waiting_lora_adapters="c"} <unix time>
//
// whose value is the time it was last set: each change of adapters leaves a new series behind, so only
// the newest sample of each engine is current. It is a plain comparable value: the adapter lists are
// strings of sorted, distinct, comma-separated names.
type LoRA struct {
	// Running are the adapters of the requests running now (vLLM loads an adapter into one of its
	// MaxLoRA GPU slots to run it), and Waiting those of the requests queued.
	Running, Waiting string
	// MaxLoRA is the number of adapter slots (vLLM's --max-loras), summed over engines; 0 when the target
	// does not report LoRA.
	MaxLoRA int
}

// Reported is true when the target reports LoRA residency at all.
func (l LoRA) Reported() bool { return l.MaxLoRA > 0 }

// IsRunning reports whether adapter runs on the target; IsWaiting whether requests for it wait there.
// Both are O(len of the list) and do not allocate.
func (l LoRA) IsRunning(adapter string) bool { return listHas(l.Running, adapter) }

// IsWaiting reports whether requests for adapter are queued on the target.
func (l LoRA) IsWaiting(adapter string) bool { return listHas(l.Waiting, adapter) }

// RunningCount is the number of distinct adapters running: the adapter slots in use.
func (l LoRA) RunningCount() int {
	if l.Running == "" {
		return 0
	}
	return strings.Count(l.Running, ",") + 1
}

func listHas(list, name string) bool {
	if name == "" {
		return false
	}
	for list != "" {
		var item string
		item, list, _ = strings.Cut(list, ",")
		if item == name {
			return true
		}
	}
	return false
}

// Bounds on what one scrape may report, so a Snapshot stays small whatever a target sends.
const (
	maxAdapters      = 256
	maxAdapterName   = 256
	maxAdapterEngine = 64
)

// loraFromLabels reads vllm:lora_requests_info: the newest series (highest value) of each engine label,
// adapters unioned over engines, slots summed. Names longer than maxAdapterName are dropped, and at most
// maxAdapters are kept per list.
func loraFromLabels(mf *dto.MetricFamily, model string) LoRA {
	type newest struct {
		at     float64
		labels []*dto.LabelPair
	}
	var engines []string
	var latest []newest
	for _, m := range mf.GetMetric() {
		at, ok := sampleValue(m, model)
		if !ok {
			continue
		}
		engine := labelValue(m.GetLabel(), "engine")
		i := slices.Index(engines, engine)
		switch {
		case i < 0 && len(engines) < maxAdapterEngine:
			engines = append(engines, engine)
			latest = append(latest, newest{at, m.GetLabel()})
		case i >= 0 && at > latest[i].at:
			latest[i] = newest{at, m.GetLabel()}
		}
	}
	var l LoRA
	var running, waiting []string
	for _, n := range latest {
		slots := parseCount(labelValue(n.labels, "max_lora"))
		l.MaxLoRA = int(min(int64(l.MaxLoRA)+int64(slots), maxBlocks))
		running = appendAdapters(running, labelValue(n.labels, "running_lora_adapters"))
		waiting = appendAdapters(waiting, labelValue(n.labels, "waiting_lora_adapters"))
	}
	if l.MaxLoRA == 0 {
		return LoRA{}
	}
	l.Running, l.Waiting = joinAdapters(running), joinAdapters(waiting)
	return l
}

func labelValue(labels []*dto.LabelPair, name string) string {
	for _, lp := range labels {
		if lp.GetName() == name {
			return lp.GetValue()
		}
	}
	return ""
}

func appendAdapters(list []string, csv string) []string {
	for csv != "" && len(list) < maxAdapters {
		var name string
		name, csv, _ = strings.Cut(csv, ",")
		if name = strings.TrimSpace(name); name != "" && len(name) <= maxAdapterName {
			list = append(list, name)
		}
	}
	return list
}

func joinAdapters(list []string) string {
	slices.Sort(list)
	return strings.Join(slices.Compact(list), ",")
}

// modelName returns the model_name label shared by every matching series of the family name, or "".
func modelName(families map[string]*dto.MetricFamily, name, model string) string {
	found := ""
	for _, m := range families[name].GetMetric() {
		if !matchesModel(m, model) {
			continue
		}
		v := labelValue(m.GetLabel(), modelLabel)
		switch {
		case v == "":
		case found == "":
			found = v
		case found != v:
			return ""
		}
	}
	return found
}

// String renders l for logs and reports.
func (l LoRA) String() string {
	return "running=" + l.Running + " waiting=" + l.Waiting + " max_lora=" + strconv.Itoa(l.MaxLoRA)
}

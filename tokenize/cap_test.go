package tokenize

import (
	"fmt"
	"reflect"
	"strings"
	"testing"
)

// hugeChat builds a chat request of n messages of varied shapes: tiny ones, long ones with step
// boundaries, names, tool calls, content parts, escapes, empty content, and a tools array after
// the messages (so that it is counted first but parsed last).
func hugeChat(n int, salt string) string {
	long := strings.Repeat("All work and no play makes Jack a dull boy. ", 30) // 1,320 bytes: 5 steps
	var b strings.Builder
	b.WriteString(`{"model":"m","messages":[`)
	for i := range n {
		if i > 0 {
			b.WriteByte(',')
		}
		switch i % 7 {
		case 0:
			fmt.Fprintf(&b, `{"role":"user","content":"%s %d"}`, salt, i)
		case 1:
			fmt.Fprintf(&b, `{"role":"assistant","content":"%s %d %s"}`, salt, i, long)
		case 2:
			fmt.Fprintf(&b, `{"role":"user","name":"alice","content":[{"type":"text","text":"caf\u00e9 %d"},{"type":"image_url","image_url":{"url":"x"}}]}`, i)
		case 3:
			fmt.Fprintf(&b, `{"role":"assistant","content":null,"tool_calls":[{"id":"c%d","type":"function","function":{"name":"f","arguments":"{\"i\":%d}"}}]}`, i, i)
		case 4:
			fmt.Fprintf(&b, `{"role":"tool","tool_call_id":"c%d","content":""}`, i-1)
		case 5:
			fmt.Fprintf(&b, `{"content":"repeated","role":"narrator","content":"%s %d"}`, salt, i)
		default:
			fmt.Fprintf(&b, `{"role":"user","content":"%d"}`, i)
		}
	}
	b.WriteString(`],"tools":[{"type":"function","function":{"name":"f","parameters":{}}}]}`)
	return b.String()
}

// checkCapped compares a capped parse with a full one: identical counts, flags and hashes, and the
// capped Messages and Boundaries are exactly the full ones of the first keepFirstMessages and the
// last keepLastMessages messages.
func checkCapped(t *testing.T, body string, api API, opts Options, purge bool) {
	t.Helper()
	enc, err := encoderFor(opts.Encoding)
	if err != nil {
		t.Fatal(err)
	}
	run := func(keepAll bool) *Request {
		t.Helper()
		if purge {
			msgCache.Purge() // both parses see the same (empty) cache, hence the same budget use
		}
		r, err := parse([]byte(body), api, enc, opts, keepAll)
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	full, capped := run(true), run(false)
	n := len(full.Messages)
	if n <= keepFirstMessages+keepLastMessages {
		t.Fatalf("only %d messages: the cap does not apply", n)
	}
	if full.PromptTokens != capped.PromptTokens || full.ToolsTokens != capped.ToolsTokens ||
		full.Estimated != capped.Estimated || full.Model != capped.Model {
		t.Errorf("capped %+v differs from full %+v", *capped, *full)
	}
	wantMsgs := append(append([]Message(nil), full.Messages[:keepFirstMessages]...), full.Messages[n-keepLastMessages:]...)
	if !reflect.DeepEqual(capped.Messages, wantMsgs) {
		t.Errorf("capped Messages differ from the full ones' first %d and last %d", keepFirstMessages, keepLastMessages)
	}
	head, tail := full.Messages[keepFirstMessages-1].End, full.Messages[n-keepLastMessages-1].End
	var wantBounds []Boundary
	for _, x := range full.Boundaries {
		if x.Tokens <= head || x.Tokens > tail {
			wantBounds = append(wantBounds, x)
		}
	}
	if !reflect.DeepEqual(capped.Boundaries, wantBounds) {
		t.Errorf("capped Boundaries (%d) differ from the full ones of the kept messages (%d)", len(capped.Boundaries), len(wantBounds))
	}
	if got, want := capped.Boundaries[len(capped.Boundaries)-1], full.Boundaries[len(full.Boundaries)-1]; got != want {
		t.Errorf("last boundary %v, want %v", got, want)
	}
	checkBoundaries(t, capped)
	// What routing takes (the first 64 and the last 192 boundaries) is the same.
	if len(full.Boundaries) > 256 && len(capped.Boundaries) > 256 {
		if !reflect.DeepEqual(capped.Boundaries[:64], full.Boundaries[:64]) ||
			!reflect.DeepEqual(capped.Boundaries[len(capped.Boundaries)-192:], full.Boundaries[len(full.Boundaries)-192:]) {
			t.Errorf("the routed boundaries differ")
		}
	}
}

func TestCapMatchesFullCount(t *testing.T) {
	for _, n := range []int{257, 1000, 5000} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			body := hugeChat(n, t.Name())
			checkCapped(t, body, APIChat, Options{Encoding: "approx"}, false)
			checkCapped(t, body, APIChat, Options{}, true)
			// A small budget: tokenized, cached and estimated messages in every part.
			checkCapped(t, body, APIChat, Options{MaxTotalBytes: 64 << 10, MaxMessageBytes: 1000}, true)
		})
	}
	t.Run("steps run out in the middle", func(t *testing.T) {
		msgs := make([]string, 400)
		for i := range msgs {
			msgs[i] = fmt.Sprintf("%d %s", i, strings.Repeat("x y ", 1100)) // 4,400 bytes: 17 steps
		}
		checkCapped(t, chatJSON(msgs...), APIChat, Options{Encoding: "approx"}, false)
	})
	t.Run("completions strings", func(t *testing.T) {
		prompts := make([]string, 1000)
		for i := range prompts {
			switch i % 3 {
			case 0:
				prompts[i] = `""` // no tokens: no boundary of its own
			case 1:
				prompts[i] = fmt.Sprintf(`"p%d"`, i)
			default:
				prompts[i] = fmt.Sprintf(`"%d %s"`, i, strings.Repeat("z ", 300))
			}
		}
		checkCapped(t, `{"prompt":[`+strings.Join(prompts, ",")+`]}`, APICompletions, Options{}, true)
	})
	t.Run("completions token arrays", func(t *testing.T) {
		arrays := make([]string, 600)
		for i := range arrays {
			ids := make([]string, 1+i*37%1000) // about 4,500 steps in all: they run out
			for j := range ids {
				ids[j] = fmt.Sprint(i*7 + j)
			}
			arrays[i] = "[" + strings.Join(ids, ",") + "]"
		}
		checkCapped(t, `{"prompt":[`+strings.Join(arrays, ",")+`]}`, APICompletions, Options{}, false)
	})
}

// TestCapKeepsEnds: a request over the cap has exactly keepFirstMessages+keepLastMessages Message
// entries, the last one ending at PromptTokens, and one under it keeps them all.
func TestCapKeepsEnds(t *testing.T) {
	tiny := make([]string, keepFirstMessages+keepLastMessages)
	for i := range tiny {
		tiny[i] = fmt.Sprint(i)
	}
	r := mustParse(t, chatJSON(tiny...), APIChat, Options{Encoding: "approx"})
	if len(r.Messages) != len(tiny) || len(r.Boundaries) != len(tiny) {
		t.Errorf("%d messages: %d entries and %d boundaries, want all", len(tiny), len(r.Messages), len(r.Boundaries))
	}
	r = mustParse(t, chatJSON(append(tiny, "one more")...), APIChat, Options{Encoding: "approx"})
	if len(r.Messages) != len(tiny) || r.Messages[len(r.Messages)-1].End != r.PromptTokens {
		t.Errorf("%d messages: %d entries, last End %d, PromptTokens %d", len(tiny)+1, len(r.Messages), r.Messages[len(r.Messages)-1].End, r.PromptTokens)
	}
}

// TestHashesAreStable pins the message and boundary hashes of varied requests to the values of
// the unoptimized parser: they are shared between proxies (and versions of them during a rolling
// update), so a faster way to compute them must not change them.
func TestHashesAreStable(t *testing.T) {
	ids := make([]string, 300)
	for i := range ids {
		ids[i] = fmt.Sprint(i * 331)
	}
	bodies := []struct {
		api  API
		body string
	}{
		{APIChat, hugeChat(300, "stable")},
		{APIChat, chatJSON("sys", strings.Repeat("All work and no play makes Jack a dull boy. ", 100))},
		{APICompletions, `{"prompt":["a b c","",` + fmt.Sprintf("%q", strings.Repeat("q ", 400)) + `]}`},
		{APICompletions, `{"prompt":[` + strings.Join(ids, ",") + `]}`},
		{APICompletions, `{"prompt":[[1,2,3],[` + strings.Join(ids, ",") + `]]}`},
	}
	var all []uint64
	for _, b := range bodies {
		r := mustParse(t, b.body, b.api, Options{Encoding: "approx"})
		for _, m := range r.Messages {
			all = append(all, m.Hash)
		}
		for _, x := range r.Boundaries {
			all = append(all, x.Hash, uint64(x.Tokens))
		}
	}
	h := uint64(0)
	for _, v := range all {
		h = chain(h, v)
	}
	const want = 0xdaf23e878ae2f896
	if h != want {
		t.Errorf("hashes digest to %#x over %d values, want %#x", h, len(all), uint64(want))
	}
}

// TestTokenIDRunMatchesSlowPath: the fast path of token-ID arrays accepts, counts, hashes and
// rejects (with the same message) exactly what the element-by-element path does.
func TestTokenIDRunMatchesSlowPath(t *testing.T) {
	prompts := []string{
		`[1,2,3]`, `[0]`, `[0,0, 0 ,0]`, "[ 1 ,\n2\t,\r3 ]", `[4294967295,4294967294]`, `[100257,9,10,99]`,
		`[1234567890,123456789,12345678]`, `[[1,2],[3],[4294967295, 0]]`,
		`[4294967296]`, `[1,4294967296]`, `[12345678901]`, `[01]`, `[1,01]`, `[1,-1]`, `[-0]`, `[1,1.0]`, `[1,1.5]`,
		`[1,1e3]`, `[1,1E3]`, `[1,]`, `[1 2]`, `[1,"a"]`, `[1,[2]]`, `[1,null]`, `[1,true]`, `[1`, `[1,`, `[1,2`,
		`[[1,2,],[3]]`, `[[1,01]]`, `[[1],[2,1.0]]`, `[[]]`, `[1,2]x`, `[1,2] `, `[1,+2]`, `[1,0x1]`,
	}
	defer func() { fastTokenIDs = true }()
	for _, prompt := range prompts {
		body := []byte(`{"prompt":` + prompt + `}`)
		var got [2]string
		for k, fast := range []bool{false, true} {
			fastTokenIDs = fast
			r, err := Parse(body, APICompletions, Options{Encoding: "approx"})
			if err != nil {
				got[k] = "error: " + err.Error()
			} else {
				got[k] = fmt.Sprintf("%+v", *r)
			}
		}
		if got[0] != got[1] {
			t.Errorf("prompt %s:\n slow %s\n fast %s", prompt, got[0], got[1])
		}
	}
}

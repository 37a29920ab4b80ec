package main

import (
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// progress draws a progress bar for the whole run on a terminal (stderr), redrawn a few times a
// second; on anything else it prints one line per finished step instead.
type progress struct {
	out   io.Writer
	tty   bool
	total atomic.Int64
	done  atomic.Int64
	start time.Time

	mu    sync.Mutex
	label string
	stop  chan struct{}
	wg    sync.WaitGroup
}

// newProgress starts a progress display for total requests.
func newProgress(out *os.File, total int) *progress {
	p := &progress{out: out, start: time.Now(), stop: make(chan struct{})}
	p.total.Store(int64(total))
	if fi, err := out.Stat(); err == nil && fi.Mode()&os.ModeCharDevice != 0 {
		p.tty = true
		p.wg.Add(1)
		go p.loop()
	}
	return p
}

// grow adds n requests to the total (a step run again).
func (p *progress) grow(n int) { p.total.Add(int64(n)) }

// add counts n finished requests.
func (p *progress) add(n int) { p.done.Add(int64(n)) }

// setLabel names the step under way.
func (p *progress) setLabel(s string) {
	p.mu.Lock()
	p.label = s
	p.mu.Unlock()
}

// stepDone reports a finished step (a line when stderr is not a terminal).
func (p *progress) stepDone(msg string) {
	if !p.tty {
		fmt.Fprintf(p.out, "[%3.0f%% %5.1fs] %s\n", p.percent(), time.Since(p.start).Seconds(), msg)
	}
}

func (p *progress) percent() float64 {
	total := p.total.Load()
	if total == 0 {
		return 100
	}
	return 100 * min(float64(p.done.Load())/float64(total), 1)
}

func (p *progress) loop() {
	defer p.wg.Done()
	t := time.NewTicker(200 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-p.stop:
			p.draw()
			fmt.Fprintln(p.out)
			return
		case <-t.C:
			p.draw()
		}
	}
}

func (p *progress) draw() {
	const width = 30
	pct := p.percent()
	filled := int(pct / 100 * width)
	p.mu.Lock()
	label := p.label
	p.mu.Unlock()
	fmt.Fprintf(p.out, "\r[%s%s] %3.0f%% %d/%d %5.1fs %-40s", strings.Repeat("#", filled), strings.Repeat("-", width-filled),
		pct, min(p.done.Load(), p.total.Load()), p.total.Load(), time.Since(p.start).Seconds(), label)
}

// finish stops the display.
func (p *progress) finish() {
	if p.tty {
		close(p.stop)
		p.wg.Wait()
	}
}

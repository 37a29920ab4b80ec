package tokenize

import (
	"math/rand"
	"testing"

	"github.com/cespare/xxhash/v2"
)

func TestXXSum64SeedMatchesDigest(t *testing.T) {
	rng := rand.New(rand.NewSource(1))
	b := make([]byte, 600)
	rng.Read(b)
	for _, seed := range []uint64{0, 1, messageHashSeed, ^uint64(0)} {
		for n := 0; n <= len(b); n++ {
			d := xxhash.NewWithSeed(seed)
			d.Write(b[:n])
			if got, want := xxSum64Seed(seed, b[:n]), d.Sum64(); got != want {
				t.Fatalf("seed %#x, %d bytes: %#x, want %#x", seed, n, got, want)
			}
		}
	}
}

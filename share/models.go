package share

import (
	"cmp"
	"context"
	"encoding/binary"
	"slices"
	"strconv"
	"time"
)

// A field of the models hash is the instance ID in hex; its value the publication time (unix
// milliseconds, 8 bytes big-endian) followed by what Config.Models returned.
const stampBytes = 8

// publishModels writes this instance's Config.Models into the hash and keeps the hash alive for Window.
// It reports whether there was anything to publish.
func (s *Sharer) publishModels(ctx context.Context) (bool, error) {
	blob := s.cfg.Models()
	if len(blob) == 0 {
		return false, nil
	}
	value := binary.BigEndian.AppendUint64(make([]byte, 0, stampBytes+len(blob)), uint64(time.Now().UnixMilli()))
	value = append(value, blob...)
	ctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	defer cancel()
	pipe := s.client.Pipeline()
	pipe.HSet(ctx, s.models, strconv.FormatUint(s.instance, 16), value)
	pipe.PExpire(ctx, s.models, s.cfg.Window)
	if _, err := pipe.Exec(ctx); err != nil {
		return true, err
	}
	s.publishedModels.Add(1)
	return true, nil
}

// readPeerModels hands the other instances' summaries of the last Window (by the Redis server's clock,
// now) to Config.PeerModels, newest first, and deletes older fields. It runs once, in the first warm-up
// that reaches Redis.
func (s *Sharer) readPeerModels(ctx context.Context, now time.Time) error {
	if s.cfg.PeerModels == nil || s.peerModelsRead {
		return nil
	}
	tctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	fields, err := s.client.HGetAll(tctx, s.models).Result()
	cancel()
	if err != nil {
		return err
	}
	s.peerModelsRead = true
	type peer struct {
		at   int64
		blob []byte
	}
	var peers []peer
	var stale []string
	own := strconv.FormatUint(s.instance, 16)
	oldest := now.Add(-s.cfg.Window).UnixMilli()
	for field, value := range fields {
		if field == own {
			continue
		}
		if len(value) <= stampBytes {
			stale = append(stale, field) // not written by this package
			continue
		}
		at := int64(binary.BigEndian.Uint64([]byte(value[:stampBytes])))
		if at < oldest {
			stale = append(stale, field)
			continue
		}
		peers = append(peers, peer{at, []byte(value[stampBytes:])})
	}
	if len(stale) > 0 {
		tctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
		s.client.HDel(tctx, s.models, stale...) // best effort: a reader skips them anyway
		cancel()
	}
	slices.SortFunc(peers, func(a, b peer) int { return cmp.Compare(b.at, a.at) })
	s.mu.Lock()
	s.peerModels = len(peers)
	s.mu.Unlock()
	if len(peers) == 0 {
		return nil
	}
	blobs := make([][]byte, len(peers))
	for i, p := range peers {
		blobs[i] = p.blob
	}
	s.cfg.PeerModels(blobs)
	return nil
}

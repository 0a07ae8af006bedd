package draftwise

import (
	"errors"
	"testing"
	"time"

	pb "github.com/draftwise/draftwise/clients/go/draftwisev1"
	"google.golang.org/grpc/codes"
)

func delta(first uint32, ids ...uint32) *pb.GenerationEvent {
	return &pb.GenerationEvent{RequestId: "r", Kind: &pb.GenerationEvent_Delta{Delta: &pb.TokenDelta{FirstTokenIndex: first, TokenIds: ids}}}
}

func finished() *pb.GenerationEvent {
	return &pb.GenerationEvent{RequestId: "r", Kind: &pb.GenerationEvent_Finished{Finished: &pb.Finished{FinishReason: pb.FinishReason_FINISH_REASON_LENGTH}}}
}

func TestProgressKeepsContiguousDeltasAndDropsReplays(t *testing.T) {
	p := progress{requestID: "r"}
	first := delta(0, 1, 2)
	first.GetDelta().ResumeHandle = "h"
	for _, ev := range []*pb.GenerationEvent{first, delta(2, 3)} {
		if keep, err := p.accept(ev); !keep || err != nil {
			t.Fatalf("accept(%v) = %v, %v", ev, keep, err)
		}
	}
	if p.handle != "h" || p.next != 3 {
		t.Fatalf("handle %q next %d", p.handle, p.next)
	}
	if keep, err := p.accept(delta(2, 3)); keep || err != nil { // replayed after a resume
		t.Fatalf("a replayed delta: %v, %v", keep, err)
	}
	if keep, _ := p.accept(finished()); !keep {
		t.Fatal("the finished event is kept")
	}
	if keep, _ := p.accept(finished()); keep {
		t.Fatal("a second finished event is dropped")
	}
}

func TestProgressRefusesAGap(t *testing.T) {
	p := progress{requestID: "r"}
	_, err := p.accept(delta(1, 7))
	var e *Error
	if !errors.As(err, &e) || e.Code != codes.DataLoss || e.RequestID != "r" {
		t.Fatalf("a gap: %v", err)
	}
	if e.Error() != "draftwise: request r: DataLoss: delta at token 1 (+1) after 0 tokens received" {
		t.Fatalf("message %q", e.Error())
	}
}

func TestTransportErrors(t *testing.T) {
	cases := map[*Error]bool{
		{Code: codes.Unavailable, Message: "connection refused"}:          true,
		{Code: codes.Internal, Message: "transport is closing"}:           true,
		{Code: codes.Unknown, Message: "read: connection reset by peer"}:  true,
		{Code: codes.InvalidArgument, Message: "top_p must be in (0, 1]"}: false,
		{Code: codes.Aborted, Message: "resumed on another connection"}:   false,
		{Code: codes.Internal, Message: "detokenization failed"}:          false,
	}
	for e, want := range cases {
		if isTransport(e) != want {
			t.Errorf("isTransport(%v) != %v", e, want)
		}
	}
}

func TestResumeBackoffDoublesUpToItsBound(t *testing.T) {
	got := []time.Duration{DefaultResume.delay(1), DefaultResume.delay(2), DefaultResume.delay(3), DefaultResume.delay(10)}
	want := []time.Duration{50 * time.Millisecond, 100 * time.Millisecond, 200 * time.Millisecond, 2 * time.Second}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("delay(%d) = %v, want %v", i, got[i], want[i])
		}
	}
}

func TestSessionRefusesAMissingOrDuplicateID(t *testing.T) {
	s := &Session{reqs: map[string]*RequestStream{}}
	if _, err := s.register(""); err == nil || err.(*Error).Code != codes.InvalidArgument {
		t.Fatalf("empty id: %v", err)
	}
	if _, err := s.register("a"); err != nil {
		t.Fatal(err)
	}
	_, err := s.register("a")
	if err == nil || err.Error() != `draftwise: request a: InvalidArgument: request id "a" is already in flight on this session` {
		t.Fatalf("duplicate id: %v", err)
	}
}

func TestQueueDeliversInOrderWithoutBlockingThePusher(t *testing.T) {
	q := newQueue()
	for i := uint32(0); i < 1000; i++ { // nobody reads yet: push never blocks
		q.push(delta(i, i), nil)
	}
	for i := uint32(0); i < 1000; i++ {
		ev, err := q.pop()
		if err != nil || ev.GetDelta().GetFirstTokenIndex() != i {
			t.Fatalf("pop %d: %v %v", i, ev, err)
		}
	}
}

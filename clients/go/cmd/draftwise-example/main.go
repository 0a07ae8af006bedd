// Command draftwise-example shows the Go client against a running server: it streams one
// completion, resumes a request whose call it dropped on purpose, multiplexes three requests
// on one Generate stream, cancelling one of them, and shows that a request the server refuses
// (top_p 2) ends alone on its stream.
//
//	draftwise-example -server 127.0.0.1:50051 [-prompt "def fibonacci(n):"] [-max-tokens 24] [-model NAME] [-json]
//
// With -json it prints one JSON object per scenario (machine-readable); otherwise the text.
// With -pause-after N it runs one scenario instead, "reconnect": it streams a request, and after
// N deltas prints {"paused": true} and waits for a line on stdin (time to break the connection,
// say) before reading on; the client resumes the request by itself if the connection broke.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/draftwise/draftwise/clients/go/draftwise"
	pb "github.com/draftwise/draftwise/clients/go/draftwisev1"
)

// result is one request's outcome as printed with -json.
type result struct {
	ID               string      `json:"id"`
	Text             string      `json:"text"`
	TokenIDs         []uint32    `json:"token_ids"`
	Deltas           [][2]uint32 `json:"deltas"`
	FinishReason     string      `json:"finish_reason"`
	PromptTokens     uint32      `json:"prompt_tokens"`
	CompletionTokens uint32      `json:"completion_tokens"`
	ResumeHandle     bool        `json:"resume_handle"`
	Resumes          int         `json:"resumes"`
	Error            string      `json:"error,omitempty"`
}

func toResult(c *draftwise.Completion, handle string, err error) result {
	r := result{ID: c.RequestID, Text: c.Text, TokenIDs: c.TokenIDs, Deltas: c.Deltas, ResumeHandle: handle != ""}
	if r.TokenIDs == nil {
		r.TokenIDs = []uint32{}
	}
	if r.Deltas == nil {
		r.Deltas = [][2]uint32{}
	}
	if f := c.Finished; f != nil {
		r.FinishReason = f.GetFinishReason().String()
		r.PromptTokens = f.GetUsage().GetPromptTokens()
		r.CompletionTokens = f.GetUsage().GetCompletionTokens()
	}
	if err != nil {
		r.Error = err.Error()
	}
	return r
}

type printer struct {
	json bool
	out  io.Writer
}

func (p printer) scenario(name string, results ...result) {
	if p.json {
		line, _ := json.Marshal(map[string]interface{}{"scenario": name, "requests": results})
		fmt.Fprintln(p.out, string(line))
		return
	}
	for _, r := range results {
		fmt.Fprintf(p.out, "== %s %s: %s (%d+%d tokens)%s\n%s\n", name, r.ID, r.FinishReason, r.PromptTokens, r.CompletionTokens, errSuffix(r.Error), r.Text)
	}
}

func errSuffix(e string) string {
	if e == "" {
		return ""
	}
	return " error: " + e
}

func params(maxTokens uint32) *pb.SamplingParams {
	return &pb.SamplingParams{MaxTokens: draftwise.Uint32(maxTokens), Temperature: draftwise.Float64(0), IgnoreEos: true}
}

func run(ctx context.Context, c *draftwise.Client, model, prompt string, maxTokens uint32, p printer) error {
	// 1. stream one completion
	s, err := c.Stream(ctx, draftwise.Request{Model: model, Prompt: draftwise.Text(prompt), Params: params(maxTokens)})
	if err != nil {
		return err
	}
	done, err := draftwise.Collect(s)
	p.scenario("stream", toResult(done, s.ResumeHandle(), err))
	if err != nil {
		return err
	}

	// 2. resume: read the first delta, drop the call, reattach with the resume handle
	s, err = c.Stream(ctx, draftwise.Request{Model: model, Prompt: draftwise.Text(prompt), Params: params(maxTokens)})
	if err != nil {
		return err
	}
	first, err := s.Recv()
	if err != nil {
		return err
	}
	s.Close() // the server keeps the request for its resume retention time
	resumed, err := c.Resume(ctx, s.ResumeHandle(), s.NextIndex())
	if err != nil {
		return err
	}
	rest, err := draftwise.Collect(resumed)
	d := first.GetDelta()
	whole := &draftwise.Completion{
		RequestID: first.GetRequestId(),
		Text:      d.GetText() + rest.Text,
		TokenIDs:  append(append([]uint32{}, d.GetTokenIds()...), rest.TokenIDs...),
		Deltas:    append([][2]uint32{{d.GetFirstTokenIndex(), uint32(len(d.GetTokenIds()))}}, rest.Deltas...),
		Finished:  rest.Finished,
	}
	p.scenario("resume", toResult(whole, s.ResumeHandle(), err))
	if err != nil {
		return err
	}

	// 3. multiplex three requests on one Generate stream; cancel the long one after its first delta
	session, err := c.Session(ctx)
	if err != nil {
		return err
	}
	defer session.Close()
	reqs := []draftwise.Request{
		{ID: "a", Model: model, Prompt: draftwise.Text(prompt), Params: params(maxTokens)},
		{ID: "b", Model: model, Prompt: draftwise.Text("class Stack:"), Params: params(maxTokens / 2)},
		{ID: "long", Model: model, Prompt: draftwise.Text("import os"), Params: params(400)},
	}
	streams := make([]*draftwise.RequestStream, len(reqs))
	for i, r := range reqs {
		if streams[i], err = session.Start(r); err != nil {
			return err
		}
	}
	type outcome struct {
		i   int
		res result
	}
	outcomes := make(chan outcome, len(reqs))
	for i, rs := range streams {
		go func(i int, rs *draftwise.RequestStream) {
			if reqs[i].ID == "long" {
				first, err := rs.Recv()
				if err != nil {
					outcomes <- outcome{i, toResult(&draftwise.Completion{RequestID: rs.ID}, "", err)}
					return
				}
				if err := rs.Cancel(); err != nil {
					outcomes <- outcome{i, toResult(&draftwise.Completion{RequestID: rs.ID}, "", err)}
					return
				}
				rest, err := draftwise.Collect(rs)
				d := first.GetDelta()
				rest.RequestID = rs.ID
				rest.Text = d.GetText() + rest.Text
				rest.TokenIDs = append(append([]uint32{}, d.GetTokenIds()...), rest.TokenIDs...)
				rest.Deltas = append([][2]uint32{{d.GetFirstTokenIndex(), uint32(len(d.GetTokenIds()))}}, rest.Deltas...)
				outcomes <- outcome{i, toResult(rest, rs.ResumeHandle(), err)}
				return
			}
			c, err := draftwise.Collect(rs)
			c.RequestID = rs.ID
			outcomes <- outcome{i, toResult(c, rs.ResumeHandle(), err)}
		}(i, rs)
	}
	results := make([]result, len(reqs))
	var firstErr error
	for range reqs {
		o := <-outcomes
		results[o.i] = o.res
		if o.res.Error != "" && firstErr == nil {
			firstErr = errors.New(o.res.Error)
		}
	}
	if err := session.CloseSend(); err != nil && firstErr == nil {
		firstErr = err
	}
	if err := session.Wait(); err != nil && firstErr == nil {
		firstErr = err
	}
	p.scenario("multiplex", results...)
	if firstErr != nil {
		return firstErr
	}

	// 4. a per-request error ends that request only: the stream and its other request go on
	session2, err := c.Session(ctx)
	if err != nil {
		return err
	}
	defer session2.Close()
	bad := &pb.SamplingParams{MaxTokens: draftwise.Uint32(4), TopP: draftwise.Float64(2)}
	badStream, err := session2.Start(draftwise.Request{ID: "bad", Model: model, Prompt: draftwise.Text(prompt), Params: bad})
	if err != nil {
		return err
	}
	goodStream, err := session2.Start(draftwise.Request{ID: "good", Model: model, Prompt: draftwise.Text(prompt), Params: params(4)})
	if err != nil {
		return err
	}
	badDone, badErr := draftwise.Collect(badStream)
	badDone.RequestID = "bad"
	goodDone, goodErr := draftwise.Collect(goodStream)
	goodDone.RequestID = "good"
	if err := session2.CloseSend(); err != nil {
		return err
	}
	if err := session2.Wait(); err != nil {
		return err
	}
	p.scenario("request-error", toResult(badDone, "", badErr), toResult(goodDone, goodStream.ResumeHandle(), goodErr))
	if goodErr != nil {
		return goodErr
	}
	if badErr == nil {
		return errors.New("a request with top_p 2 was accepted")
	}
	return nil
}

// reconnect streams one request and pauses after pauseAfter deltas until a line arrives on in.
func reconnect(ctx context.Context, c *draftwise.Client, model, prompt string, maxTokens uint32, pauseAfter int, in *bufio.Reader, p printer) error {
	s, err := c.Stream(ctx, draftwise.Request{Model: model, Prompt: draftwise.Text(prompt), Params: params(maxTokens)})
	if err != nil {
		return err
	}
	defer s.Close()
	out := &draftwise.Completion{}
	deltas := 0
	for {
		ev, err := s.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			r := toResult(out, s.ResumeHandle(), err)
			r.Resumes = s.Resumes()
			p.scenario("reconnect", r)
			return err
		}
		out.RequestID = ev.GetRequestId()
		if d := ev.GetDelta(); d != nil {
			out.Text += d.GetText()
			out.TokenIDs = append(out.TokenIDs, d.GetTokenIds()...)
			out.Deltas = append(out.Deltas, [2]uint32{d.GetFirstTokenIndex(), uint32(len(d.GetTokenIds()))})
			if deltas++; deltas == pauseAfter {
				fmt.Fprintln(p.out, `{"paused": true}`)
				if _, err := in.ReadString('\n'); err != nil {
					return fmt.Errorf("reading stdin: %w", err)
				}
			}
		}
		if f := ev.GetFinished(); f != nil {
			out.Finished = f
		}
	}
	r := toResult(out, s.ResumeHandle(), nil)
	r.Resumes = s.Resumes()
	p.scenario("reconnect", r)
	return nil
}

func main() {
	server := flag.String("server", "127.0.0.1:50051", "gateway address host:port")
	apiKey := flag.String("api-key", os.Getenv("DRAFTWISE_API_KEY"), "API key (default $DRAFTWISE_API_KEY)")
	prompt := flag.String("prompt", "def fibonacci(n):", "prompt of the streamed request")
	maxTokens := flag.Uint("max-tokens", 24, "tokens per request (greedy, EOS ignored)")
	model := flag.String("model", "", "served model name (default: the server's default model)")
	asJSON := flag.Bool("json", false, "print one JSON object per scenario")
	pauseAfter := flag.Int("pause-after", 0, "run the reconnect scenario: pause after this many deltas until a line on stdin")
	timeout := flag.Duration("timeout", 120*time.Second, "deadline of the whole run")
	flag.Parse()
	if *maxTokens < 2 {
		fmt.Fprintln(os.Stderr, "draftwise-example: -max-tokens must be at least 2")
		os.Exit(2)
	}

	var opts []draftwise.Option
	if *apiKey != "" {
		opts = append(opts, draftwise.WithAPIKey(*apiKey))
	}
	c, err := draftwise.Dial(*server, opts...)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	p := printer{json: *asJSON, out: os.Stdout}
	if *pauseAfter > 0 {
		err = reconnect(ctx, c, *model, *prompt, uint32(*maxTokens), *pauseAfter, bufio.NewReader(os.Stdin), p)
	} else {
		err = run(ctx, c, *model, *prompt, uint32(*maxTokens), p)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "draftwise-example:", err)
		os.Exit(1)
	}
}

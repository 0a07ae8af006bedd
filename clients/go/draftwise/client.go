// Package draftwise is a small typed client of the draftwise LLM inference server's public
// API, draftwise.v1.GenerateService (generated stubs in package draftwisev1).
//
//	c, err := draftwise.Dial("127.0.0.1:50051")
//	s, err := c.Stream(ctx, draftwise.Request{Prompt: draftwise.Text("def f(n):"), Params: &draftwisev1.SamplingParams{MaxTokens: draftwise.Uint32(32)}})
//	for { ev, err := s.Recv(); if err == io.EOF { break } ... }
//
// Stream runs one request on GenerateStream and resumes it with its resume handle should
// the connection drop; Session multiplexes many requests on one Generate stream (start,
// cancel, resume).
package draftwise

import (
	"context"
	"crypto/tls"
	"fmt"

	pb "github.com/draftwise/draftwise/clients/go/draftwisev1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
)

// Client is a connection to a draftwise gateway.
type Client struct {
	conn   *grpc.ClientConn
	stub   pb.GenerateServiceClient
	apiKey string
	resume ResumePolicy
}

// Option configures Dial.
type Option func(*dialConfig)

type dialConfig struct {
	apiKey string
	tls    *tls.Config
	resume ResumePolicy
}

// WithAPIKey sends "authorization: Bearer KEY" on every call (servers started with --api-key-file).
func WithAPIKey(key string) Option { return func(c *dialConfig) { c.apiKey = key } }

// WithTLS dials with TLS (nil: the system roots).
func WithTLS(cfg *tls.Config) Option {
	return func(c *dialConfig) {
		if cfg == nil {
			cfg = &tls.Config{}
		}
		c.tls = cfg
	}
}

// WithResume sets how Stream resumes a request whose connection dropped (DefaultResume
// unless given; ResumePolicy{} turns resuming off).
func WithResume(p ResumePolicy) Option { return func(c *dialConfig) { c.resume = p } }

// Dial connects to a gateway at host:port (plaintext unless WithTLS). The connection is
// made lazily: a server that is not up yet fails the first call with UNAVAILABLE.
func Dial(target string, opts ...Option) (*Client, error) {
	cfg := dialConfig{resume: DefaultResume}
	for _, o := range opts {
		o(&cfg)
	}
	var creds grpc.DialOption
	if cfg.tls != nil {
		creds = grpc.WithTransportCredentials(credentials.NewTLS(cfg.tls))
	} else {
		creds = grpc.WithInsecure()
	}
	conn, err := grpc.Dial(target, creds)
	if err != nil {
		return nil, fmt.Errorf("draftwise: dial %s: %w", target, err)
	}
	return &Client{conn: conn, stub: pb.NewGenerateServiceClient(conn), apiKey: cfg.apiKey, resume: cfg.resume}, nil
}

// Close closes the connection.
func (c *Client) Close() error { return c.conn.Close() }

// Stub is the generated GenerateService client, for anything the wrapper does not cover.
func (c *Client) Stub() pb.GenerateServiceClient { return c.stub }

func (c *Client) outgoing(ctx context.Context) context.Context {
	if c.apiKey == "" {
		return ctx
	}
	return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+c.apiKey)
}

// ListModels returns the served models and the default one.
func (c *Client) ListModels(ctx context.Context) (*pb.ListModelsResponse, error) {
	return c.stub.ListModels(c.outgoing(ctx), &pb.ListModelsRequest{})
}

// Request is one generation request.
type Request struct {
	// ID names the request on a Session (unique among its in-flight requests); on Stream it
	// may be empty (the server picks one).
	ID string
	// Model is a served model's name; empty: the default model.
	Model string
	// Prompt is Text(...), Chat(...) or TokenIDs(...).
	Prompt *pb.Prompt
	// Params are the sampling parameters; nil: the server's defaults.
	Params *pb.SamplingParams
	// Speculation are per-request speculative decoding settings; nil: the model's.
	Speculation *pb.SpeculationOptions
}

func (r Request) start() *pb.StartGeneration {
	return &pb.StartGeneration{
		RequestId:      r.ID,
		Model:          r.Model,
		Prompt:         r.Prompt,
		SamplingParams: r.Params,
		Speculation:    r.Speculation,
	}
}

// Text is a text prompt (tokenized by the server).
func Text(s string) *pb.Prompt { return &pb.Prompt{Kind: &pb.Prompt_Text{Text: s}} }

// TokenIDs is a prompt of token ids, used as they are.
func TokenIDs(ids ...uint32) *pb.Prompt {
	return &pb.Prompt{Kind: &pb.Prompt_TokenIds{TokenIds: &pb.TokenIds{Ids: ids}}}
}

// Message is one chat message.
func Message(role, content string) *pb.ChatMessage {
	return &pb.ChatMessage{Role: role, Content: content}
}

// Chat is a conversation prompt, rendered by the server with the model's chat template.
func Chat(messages ...*pb.ChatMessage) *pb.Prompt {
	return &pb.Prompt{Kind: &pb.Prompt_Chat{Chat: &pb.ChatMessages{Messages: messages}}}
}

// Uint32, Float64 and Int64 make the pointers that optional proto fields take.
func Uint32(v uint32) *uint32 { return &v }

// Float64 returns a pointer to v (for optional double fields such as Temperature).
func Float64(v float64) *float64 { return &v }

// Int64 returns a pointer to v (for the optional Seed).
func Int64(v int64) *int64 { return &v }

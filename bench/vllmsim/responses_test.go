package vllmsim

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"testing"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/responses"
)

// TestResponsesAPI drives the simulator's Responses API with the official Go client: whole and streamed
// answers of the asked length with their usage, a continuation by previous_response_id that prefills the
// stored conversation (its prompt holds the previous one and its answer, found cached), 404 for a
// response this server did not store or was told not to, and retrieval and deletion of a stored one.
func TestResponsesAPI(t *testing.T) {
	_, ts := newTestServer(t, Config{Model: "sim-model"})
	client := openai.NewClient(option.WithBaseURL(ts.URL+"/v1/"), option.WithAPIKey("x"), option.WithMaxRetries(0))
	ctx := context.Background()
	question := strings.Repeat("Tell me about the weather in Paris. ", 20)

	first, err := client.Responses.New(ctx, responses.ResponseNewParams{
		Model:           "sim-model",
		Instructions:    openai.String("Be brief."),
		Input:           responses.ResponseNewParamsInputUnion{OfString: openai.String(question)},
		MaxOutputTokens: openai.Int(12),
	})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(first.ID, "resp_") || len(first.OutputText()) != 4*12 || first.Status != "incomplete" ||
		first.Usage.OutputTokens != 12 || first.Usage.InputTokens < int64(len(question)/4) {
		t.Fatalf("first response %s %q status %s usage %+v: want 12 tokens, incomplete, and the question counted", first.ID, first.OutputText(), first.Status, first.Usage)
	}

	// The continuation, streamed: its prompt is the first's conversation, its answer and the new input.
	stream := client.Responses.NewStreaming(ctx, responses.ResponseNewParams{
		Model:              "sim-model",
		Instructions:       openai.String("Be brief."), // instructions are not carried over
		PreviousResponseID: openai.String(first.ID),
		Input: responses.ResponseNewParamsInputUnion{OfInputItemList: responses.ResponseInputParam{
			responses.ResponseInputItemParamOfMessage("And tomorrow?", responses.EasyInputMessageRoleUser),
		}},
		MaxOutputTokens: openai.Int(20),
	})
	var text string
	var types []string
	var final responses.Response
	for stream.Next() {
		ev := stream.Current()
		types = append(types, ev.Type)
		switch ev.Type {
		case "response.output_text.delta":
			text += ev.Delta
		case "response.completed", "response.incomplete":
			final = ev.Response
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	stream.Close()
	if len(types) < 8 || types[0] != "response.created" || types[len(types)-1] != "response.incomplete" {
		t.Errorf("events %v: want response.created first and response.incomplete last", types)
	}
	if len(text) != 4*20 || final.OutputText() != text || final.PreviousResponseID != first.ID {
		t.Errorf("streamed %q, final %q continuing %q: want 20 tokens, the same in the final response, continuing %s", text, final.OutputText(), final.PreviousResponseID, first.ID)
	}
	if final.Usage.InputTokens <= first.Usage.InputTokens+first.Usage.OutputTokens ||
		final.Usage.InputTokensDetails.CachedTokens < first.Usage.InputTokens/2 {
		t.Errorf("continuation usage %+v after %+v: want the first conversation and its answer in the prompt, found cached", final.Usage, first.Usage)
	}

	notFound := func(what string, err error) {
		t.Helper()
		var apiErr *openai.Error
		if !errors.As(err, &apiErr) || apiErr.StatusCode != http.StatusNotFound {
			t.Errorf("%s: error %v, want 404", what, err)
		}
	}
	_, err = client.Responses.New(ctx, responses.ResponseNewParams{
		Model: "sim-model", PreviousResponseID: openai.String("resp_elsewhere"),
		Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("hi")},
	})
	notFound("continuing an unknown response", err)
	unstored, err := client.Responses.New(ctx, responses.ResponseNewParams{
		Model: "sim-model", Store: openai.Bool(false), MaxOutputTokens: openai.Int(2),
		Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("hi")},
	})
	if err != nil {
		t.Fatal(err)
	}
	_, err = client.Responses.New(ctx, responses.ResponseNewParams{
		Model: "sim-model", PreviousResponseID: openai.String(unstored.ID),
		Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("hi")},
	})
	notFound("continuing a response stored with store false", err)

	if got, err := client.Responses.Get(ctx, first.ID, responses.ResponseGetParams{}); err != nil || got.ID != first.ID {
		t.Errorf("retrieving %s: %+v, %v", first.ID, got, err)
	}
	if err := client.Responses.Delete(ctx, first.ID); err != nil {
		t.Errorf("deleting %s: %v", first.ID, err)
	}
	_, err = client.Responses.Get(ctx, first.ID, responses.ResponseGetParams{})
	notFound("retrieving a deleted response", err)
}

func TestResponseStoreBounded(t *testing.T) {
	var st responseStore
	for i := range maxStoredResponses + 10 {
		st.put(strings.Repeat("x", i%7)+string(rune('a'+i%26))+strings.Repeat("y", i/26), []byte("c"))
	}
	if len(st.convs) != maxStoredResponses || len(st.order) != maxStoredResponses {
		t.Errorf("%d stored (%d in order), want %d", len(st.convs), len(st.order), maxStoredResponses)
	}
}

// A client as Node applications write it: the official `openai` npm package, one non-streamed and one
// streamed chat completion through the balancer, a stored response continued for three turns, and a
// batch of embeddings. It prints one JSON line per result for the Go test (cmd/caddy/demo_node_test.go)
// to check. Usage:
//
//   NODE_PATH=<dir>/node_modules OPENAI_BASE_URL=http://127.0.0.1:8080/v1 node openai_client.cjs
//
// The API key is a placeholder: the demo's simulated backends do not check it.
const OpenAI = require('openai');

async function main() {
  const client = new OpenAI({ baseURL: process.env.OPENAI_BASE_URL, apiKey: 'demo', maxRetries: 0 });
  const messages = [
    { role: 'system', content: 'You are a helpful assistant.' },
    { role: 'user', content: 'Say hello from Node.' },
  ];

  const whole = await client.chat.completions.create({ model: 'sim-model', messages, max_tokens: 12 });
  console.log(JSON.stringify({
    kind: 'whole',
    id: whole.id,
    model: whole.model,
    content: whole.choices[0].message.content,
    finish_reason: whole.choices[0].finish_reason,
    usage: whole.usage,
  }));

  const stream = await client.chat.completions.create({
    model: 'sim-model', messages, max_tokens: 20, stream: true, stream_options: { include_usage: true },
  });
  let content = '';
  let chunks = 0;
  let finish = null;
  let usage = null;
  const ids = new Set();
  for await (const chunk of stream) {
    chunks++;
    ids.add(chunk.id);
    for (const choice of chunk.choices) {
      content += choice.delta.content || '';
      finish = choice.finish_reason || finish;
    }
    if (chunk.usage) usage = chunk.usage;
  }
  console.log(JSON.stringify({ kind: 'stream', ids: ids.size, chunks, content, finish_reason: finish, usage }));

  // The Responses API: a stored response continued by previous_response_id for three turns (the second
  // streamed), then retrieved. The response is stored on the one backend that produced it, and any
  // other answers 404 (which throws here): every request must reach that backend.
  // (The continuations carry no instructions, so no prefix of theirs leads to that backend.)
  const ask = { model: 'sim-model', max_output_tokens: 8 };
  let resp = await client.responses.create({ ...ask, instructions: 'Be brief.', input: 'Say hello from Node.' });
  const ids2 = [resp.id];
  let streamed = '';
  for (let turn = 1; turn <= 3; turn++) {
    const params = { ...ask, previous_response_id: resp.id, input: [{ role: 'user', content: `Turn ${turn}: and then?` }] };
    if (turn === 2) {
      for await (const ev of await client.responses.create({ ...params, stream: true })) {
        if (ev.type === 'response.output_text.delta') streamed += ev.delta;
        if (ev.type === 'response.completed' || ev.type === 'response.incomplete') resp = ev.response;
      }
    } else {
      resp = await client.responses.create(params);
    }
    ids2.push(resp.id);
  }
  const retrieved = await client.responses.retrieve(resp.id);
  console.log(JSON.stringify({
    kind: 'responses',
    ids: new Set(ids2).size,
    chunks: streamed.length / 4,
    content: resp.output[0].content[0].text,
    response_usage: resp.usage,
    retrieved: retrieved.id === resp.id,
  }));

  // Embeddings: the package asks for base64 by default and decodes it to floats.
  const emb = await client.embeddings.create({ model: 'sim-model', input: ['Hello from Node.', 'And again.'] });
  console.log(JSON.stringify({
    kind: 'embeddings',
    ids: emb.data.length,
    chunks: emb.data[0].embedding.length,
    embedding_norm: Math.hypot(...emb.data[1].embedding),
    usage: emb.usage,
  }));
}

main().catch((err) => {
  console.error(`openai client failed: ${err.stack || err}`);
  process.exit(1);
});

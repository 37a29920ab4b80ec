// A client as Node applications write it: the official `openai` npm package, one non-streamed and one
// streamed chat completion through the balancer. It prints one JSON line per completion for the Go
// test (cmd/caddy/demo_node_test.go) to check. Usage:
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
}

main().catch((err) => {
  console.error(`openai client failed: ${err.stack || err}`);
  process.exit(1);
});

// An agent written against Langfuse's JS SDK, pointed at combee by the SDK's
// own environment variables only (LANGFUSE_BASE_URL, LANGFUSE_PUBLIC_KEY = the
// combee key's prefix, LANGFUSE_SECRET_KEY = the combee key), set up as
// Langfuse's docs show: `LangfuseClient` (@langfuse/client) for prompts, the
// OpenTelemetry Node SDK with `LangfuseSpanProcessor` (@langfuse/otel) for
// traces, and `startActiveObservation` (@langfuse/tracing) around each model
// call, the fetched prompt linked to the generation.
//
// Usage: node agent_langfuse_client.mjs fetch PROMPT VERSION
//        node agent_langfuse_client.mjs fallback PROMPT      (combee is down)
// Prints one JSON line with what the SDK served.
import { LangfuseClient } from '@langfuse/client';
import { LangfuseSpanProcessor } from '@langfuse/otel';
import { startActiveObservation } from '@langfuse/tracing';
import { NodeSDK } from '@opentelemetry/sdk-node';

const [mode, name, version] = process.argv.slice(2);
const QUESTIONS = [
  'Where is order 1001?',
  'Can I return shoes after 40 days?',
  'How do I reset my password?',
  'Do you ship to Norway?',
];
const FALLBACK = 'You are a support agent (fallback).';

const langfuse = new LangfuseClient();

if (mode === 'fallback') {
  const prompt = await langfuse.prompt.get(name, { fallback: FALLBACK, maxRetries: 0, fetchTimeoutMs: 2000 });
  console.log(JSON.stringify({ text: prompt.prompt, is_fallback: prompt.isFallback }));
  process.exit(0);
}

const sdk = new NodeSDK({ spanProcessors: [new LangfuseSpanProcessor()] });
sdk.start();

const byLabel = await langfuse.prompt.get(name, { label: 'production', cacheTtlSeconds: 0 });
const byVersion = await langfuse.prompt.get(name, { version: Number(version), cacheTtlSeconds: 0 });

/** The model call: an OpenAI-compatible chat completion. */
async function complete(messages) {
  const res = await fetch(`${process.env.OPENAI_BASE_URL}/chat/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json', authorization: `Bearer ${process.env.OPENAI_API_KEY}` },
    body: JSON.stringify({ model: 'gpt-4o-mini', messages }),
  });
  if (!res.ok) throw new Error(`model call failed: ${res.status}`);
  return (await res.json()).choices[0].message;
}

for (const question of QUESTIONS) {
  const messages = [
    { role: 'system', content: byLabel.compile({ topic: 'orders' }) },
    { role: 'user', content: question },
  ];
  await startActiveObservation(
    'support-answer',
    async (generation) => {
      generation.update({ model: 'gpt-4o-mini', input: messages, prompt: byLabel });
      const answer = await complete(messages);
      generation.update({ output: answer });
    },
    { asType: 'generation' },
  );
}
await sdk.shutdown();
console.log(
  JSON.stringify({
    label: { version: byLabel.version, text: byLabel.prompt, compiled: byLabel.compile({ topic: 'orders' }), labels: byLabel.labels, is_fallback: byLabel.isFallback },
    version: { version: byVersion.version, text: byVersion.prompt, labels: byVersion.labels },
  }),
);

// An agent written with the Vercel AI SDK (npm `ai`) and an OpenAI-compatible
// provider, its telemetry set up as the AI SDK's docs say for Node.js: the
// OpenTelemetry Node SDK with the OTLP/HTTP (protobuf) exporter, configured by
// the standard OTEL_EXPORTER_OTLP_* variables, and `registerTelemetry(new
// OpenTelemetry({ runtimeContext: true }))` from `@ai-sdk/otel`. The combee
// prompt is named through the runtime context the SDK passes to telemetry
// (`combee.prompt`, `combee.prompt.version`). Each `generateText` call is one trace.
//
// `legacy` uses `LegacyOpenTelemetry`, which writes the AI SDK's own `ai.*`
// attributes instead of the GenAI conventions.
//
// Usage: node agent_vercel_ai.mjs PROMPT VERSION [current|legacy]   (prints {"calls": n})
import { createOpenAICompatible } from '@ai-sdk/openai-compatible';
import { LegacyOpenTelemetry, OpenTelemetry } from '@ai-sdk/otel';
import { OTLPTraceExporter } from '@opentelemetry/exporter-trace-otlp-proto';
import { NodeSDK } from '@opentelemetry/sdk-node';
import { generateText, registerTelemetry } from 'ai';

const [prompt, version, mode = 'current'] = process.argv.slice(2);
const QUESTIONS = [
  'Where is order 1001?',
  'Can I return shoes after 40 days?',
  'How do I reset my password?',
  'Do you ship to Norway?',
];

const sdk = new NodeSDK({ traceExporter: new OTLPTraceExporter() });
sdk.start();
const Integration = mode === 'legacy' ? LegacyOpenTelemetry : OpenTelemetry;
registerTelemetry(new Integration({ runtimeContext: true }));

const provider = createOpenAICompatible({
  name: 'simulator',
  baseURL: process.env.OPENAI_BASE_URL,
  apiKey: process.env.OPENAI_API_KEY,
});

for (const question of QUESTIONS) {
  const { text } = await generateText({
    model: provider('gpt-4o-mini'),
    system: 'You are a support agent.',
    prompt: question,
    runtimeContext: { 'combee.prompt': prompt, 'combee.prompt.version': Number(version) },
    telemetry: { includeRuntimeContext: { 'combee.prompt': true, 'combee.prompt.version': true } },
  });
  if (!text) throw new Error('no answer');
}
await sdk.shutdown();
console.log(JSON.stringify({ calls: QUESTIONS.length }));

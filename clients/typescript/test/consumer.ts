// Type-checked (not run) by scripts/test-typescript: what an agent written
// in TypeScript does with the client, against the published declarations.
import { Combee, CombeeAPIError, type Prompt, type TraceHandle } from '../dist/esm/index.js';

async function answer(question: string): Promise<string> {
  return `echo: ${question}`;
}

export async function agent(client: Combee): Promise<TraceHandle> {
  const prompt: Prompt = await client.getPrompt('support-agent', { subject: 'user-42', fallback: 'You are a support agent.' });
  const system: string = prompt.compile({ product: 'Acme' });
  const version: number | null = prompt.version;
  const output = await answer(system);
  const handle = client.logTrace(prompt, { input: { question: 'hi' }, output, feedback: { success: version !== null } });
  client.feedback(handle, { score: 0.5, comment: 'late' });
  const stored: boolean = await client.flush(5);
  if (!stored) throw new CombeeAPIError(500, 'not stored');
  return handle;
}

/**
 * The TypeScript client of combee: `Combee` fetches the prompt an agent runs
 * with and sends back the traces of its runs. No runtime dependencies: the
 * global `fetch` only (Node.js ≥ 20, Deno, Bun, edge runtimes).
 */
export { Combee, Run, SUBJECT_HEADER, type CombeeOptions, type GetPromptOptions, type Logger } from './client.js';
export { CombeeAPIError, CombeeUnavailable } from './errors.js';
export { MissingVariable, Prompt, placeholders, type Arm, type PromptSource } from './prompt.js';
export { TraceHandle, type Feedback, type TraceInput, type TraceStats, type TraceStatus } from './traces.js';

/**
 * The I/O-free part of sending traces: what a trace and its feedback look
 * like on the wire, the handle an agent keeps, batches with their
 * idempotency keys, and how an answer to `POST /v1/traces` is read.
 */
import { apiError, isUnavailable } from './errors.js';
import type { Prompt } from './prompt.js';

/** Feedback on a run; fields given later replace earlier ones. */
export interface Feedback {
  score?: number;
  success?: boolean;
  /** Any JSON. */
  groundTruth?: unknown;
  comment?: string;
  error?: string;
}

/** A run, as `logTrace` takes it. */
export interface TraceInput {
  /** The task input: any JSON except `null` / `undefined`. */
  input: unknown;
  output?: unknown;
  /** Messages, steps, tool calls: any JSON. */
  trajectory?: unknown;
  feedback?: Feedback;
  /** The agent's own reflection (any JSON). */
  reflection?: unknown;
  metadata?: Record<string, unknown>;
  /** Your id for the run (a fresh UUID when not given). */
  externalId?: string;
  /** The version the agent ran with, when the prompt is given by name. */
  promptVersion?: number;
}

export type TraceStatus = 'queued' | 'stored' | 'dropped';

/**
 * What `logTrace` returns: a trace on its way to the server. The server
 * assigns trace ids, so `id` is `null` until the trace's batch is stored —
 * after `flush()` at the latest. `externalId` is known at once.
 */
export class TraceHandle {
  #id: string | null = null;
  #status: TraceStatus = 'queued';
  #settled: Promise<string | null>;
  #settle!: (id: string | null) => void;

  constructor(readonly externalId: string) {
    this.#settled = new Promise((resolve) => (this.#settle = resolve));
  }

  /** The server's id once stored, else `null`. */
  get id(): string | null {
    return this.#id;
  }

  get status(): TraceStatus {
    return this.#status;
  }

  /** Resolves with the server id once stored, or `null` once dropped. */
  settled(): Promise<string | null> {
    return this.#settled;
  }

  /** @internal */
  _stored(id: string): void {
    this.#id = id;
    this.#status = 'stored';
    this.#settle(id);
  }

  /** @internal */
  _dropped(): void {
    this.#status = 'dropped';
    this.#settle(null);
  }
}

/** A deep JSON copy taken now; values JSON cannot carry become strings (non-finite numbers, bigints, symbols). */
export function jsonSafe(value: unknown): unknown {
  const text = JSON.stringify(value, (_, v: unknown) => {
    if (typeof v === 'number' && !Number.isFinite(v)) return String(v);
    if (typeof v === 'bigint' || typeof v === 'symbol' || typeof v === 'function') return String(v);
    return v;
  });
  return text === undefined ? null : JSON.parse(text);
}

const FEEDBACK_FIELDS = ['score', 'success', 'groundTruth', 'comment', 'error'] as const;

/** The wire form of feedback; throws for unknown fields and a non-finite score (call-site bugs). */
export function feedbackBody(f: Feedback): Record<string, unknown> {
  const unknown = Object.keys(f).filter((k) => !(FEEDBACK_FIELDS as readonly string[]).includes(k));
  if (unknown.length) throw new TypeError(`unknown feedback fields ${unknown.join(', ')}; known: ${FEEDBACK_FIELDS.join(', ')}`);
  const body: Record<string, unknown> = {};
  if (f.score != null) {
    const score = Number(f.score);
    if (!Number.isFinite(score)) throw new TypeError('score must be a finite number');
    body.score = score;
  }
  if (f.success != null) body.success = Boolean(f.success);
  if (f.groundTruth !== undefined) body.ground_truth = jsonSafe(f.groundTruth);
  if (f.comment != null) body.comment = String(f.comment);
  if (f.error != null) body.error = String(f.error);
  return body;
}

/** The wire form of a trace (a copy: later changes by the agent are not sent). */
export function traceBody(prompt: Prompt | string, t: TraceInput, externalId: string): Record<string, unknown> {
  if (t.input === undefined || t.input === null) throw new TypeError('a trace needs an `input` (any JSON value except null)');
  const isPrompt = typeof prompt !== 'string';
  const name = isPrompt ? prompt.name : prompt;
  if (!name) throw new TypeError('a trace needs a prompt name');
  const version = t.promptVersion ?? (isPrompt ? prompt.version : null);
  const metadata: Record<string, unknown> = { ...(t.metadata ?? {}) };
  if (isPrompt && prompt.arm && !('arm' in metadata)) metadata.arm = { ...prompt.arm };
  const body: Record<string, unknown> = { prompt: name, input: t.input, external_id: externalId };
  if (version != null) body.prompt_version = Math.trunc(version);
  if (t.output !== undefined) body.output = t.output;
  if (t.trajectory !== undefined) body.trajectory = t.trajectory;
  if (t.feedback) body.feedback = feedbackBody(t.feedback);
  if (t.reflection !== undefined) body.reflection = t.reflection;
  if (Object.keys(metadata).length) body.metadata = metadata;
  return jsonSafe(body) as Record<string, unknown>;
}

export interface PendingTrace {
  body: Record<string, unknown>;
  handle: TraceHandle;
}

export interface PendingFeedback {
  target: TraceHandle | string;
  body: Record<string, unknown>;
}

/** Traces sent together under one Idempotency-Key, reused by every retry of the same body. */
export class Batch {
  attempts = 0;
  readonly key = `combee-ts-${crypto.randomUUID()}`;
  constructor(readonly traces: PendingTrace[]) {}

  payload(): string {
    return JSON.stringify({ traces: this.traces.map((t) => t.body) });
  }
}

/** What to do after an answer to a batch. */
export type Outcome =
  | { kind: 'stored'; ids: string[] }
  | { kind: 'retry'; reason: string }
  | { kind: 'drop-one'; index: number; reason: string }
  | { kind: 'split'; reason: string }
  | { kind: 'drop-all'; reason: string };

/** Reads the answer to `POST /v1/traces`. */
export function batchOutcome(status: number, body: string, size: number): Outcome {
  if (status === 200 || status === 201) {
    try {
      const ids: unknown = JSON.parse(body).ids;
      if (Array.isArray(ids) && ids.length === size) return { kind: 'stored', ids: ids.map(String) };
    } catch {
      // fall through: retry, the answer will be replayed
    }
    return { kind: 'retry', reason: `unreadable answer to a stored batch (HTTP ${status})` };
  }
  // 409: the same key is still in flight on the server; its answer will be replayable.
  if (status === 409 || isUnavailable(status)) return { kind: 'retry', reason: `HTTP ${status}` };
  const err = apiError(status, body);
  const m = /^traces\[(\d+)\]/.exec(err.detail ?? '');
  if (m && Number(m[1]) < size && (status === 413 || status === 422)) {
    return { kind: 'drop-one', index: Number(m[1]), reason: err.message };
  }
  if (status === 413 && size > 1) return { kind: 'split', reason: err.message };
  return { kind: 'drop-all', reason: err.message };
}

/** Exponential from 100 ms, capped, with jitter so many agents do not retry in step. */
export function backoffMs(attempt: number, capMs: number): number {
  return Math.min(capMs, 100 * 2 ** Math.min(attempt, 20)) * (0.5 + Math.random() / 2);
}

/** Counters of the trace queue (`client.stats`). */
export interface TraceStats {
  queued: number;
  sent: number;
  droppedQueueFull: number;
  rejected: number;
  lostAtClose: number;
  retries: number;
  feedbackSent: number;
  feedbackDropped: number;
}

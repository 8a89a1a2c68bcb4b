/**
 * `Combee`: fetch prompts (cached, revalidated with their ETag in the
 * background, the last known text or a fallback when the server is down)
 * and send traces in background batches that retry with idempotency keys and
 * never block the agent. Uses only the global `fetch`, timers and
 * `crypto.randomUUID`, so it runs on Node.js ≥ 20 and on edge runtimes; on
 * Node.js it also flushes queued traces when the process is about to exit.
 */
import { CombeeUnavailable, apiError, isUnavailable } from './errors.js';
import { Prompt, parsePrompt } from './prompt.js';
import {
  Batch,
  type Feedback,
  type Outcome,
  type PendingFeedback,
  type PendingTrace,
  TraceHandle,
  type TraceInput,
  type TraceStats,
  backoffMs,
  batchOutcome,
  feedbackBody,
  traceBody,
} from './traces.js';

export const SUBJECT_HEADER = 'Combee-Subject';
const USER_AGENT = 'combee-typescript/0.1.0';
const DEFAULT_URL = 'http://127.0.0.1:8080';
/** After a failed request for a prompt, how long calls are answered without asking the server again. */
const UNAVAILABLE_RETRY_MS = 1000;

/** Where the client logs (default: `console`). */
export interface Logger {
  warn(message: string): void;
  error(message: string): void;
}

export interface CombeeOptions {
  /** Default `$COMBEE_URL`, else `http://127.0.0.1:8080`. */
  baseUrl?: string;
  /** Sent as `Authorization: Bearer`; default `$COMBEE_API_KEY`. Never logged. */
  apiKey?: string;
  /** Seconds a prompt is used without asking the server (default 60). */
  cacheTtl?: number;
  /** Seconds, every request (default 5). */
  timeout?: number;
  /** Traces per `POST /v1/traces`, 1–500 (default 100). */
  batchSize?: number;
  /** Seconds the oldest queued trace may wait (default 1). */
  flushInterval?: number;
  /** Queued traces before new ones are dropped (default 10 000). */
  maxQueue?: number;
  /** Seconds, the longest pause between retries (default 30). */
  maxBackoff?: number;
  /** Seconds `close()` (and process exit) waits for queued traces (default 5). */
  closeTimeout?: number;
  /** Your own `fetch` (proxies, instrumentation); default the global one. */
  fetch?: typeof fetch;
  logger?: Logger;
}

export interface GetPromptOptions {
  /** A label (default: the server's `production`). */
  label?: string;
  /** A user, session or tenant id, sent as `Combee-Subject`: an experiment gives each subject a stable arm. */
  subject?: string;
  /** Served (with `source: "fallback"`, `version: null`) when the server is down and nothing is cached. */
  fallback?: string;
}

interface CacheEntry {
  prompt: Prompt;
  etag: string | null;
  freshUntil: number;
  revalidating: boolean;
}

interface NodeProcess {
  env?: Record<string, string | undefined>;
  once?(event: 'beforeExit', listener: () => void): unknown;
  off?(event: 'beforeExit', listener: () => void): unknown;
}

const nodeProcess = (globalThis as { process?: NodeProcess }).process;

function positive(name: string, value: number, min = 0): number {
  if (!(typeof value === 'number' && Number.isFinite(value) && value >= min)) throw new RangeError(`${name} must be a number >= ${min}`);
  return value;
}

/** Resolves after `ms`, on a timer that does not keep a Node.js process alive. */
function sleep(ms: number, keepAlive = false): Promise<void> {
  return new Promise((resolve) => {
    const t = setTimeout(resolve, ms) as unknown as { unref?(): void };
    if (!keepAlive) t.unref?.();
  });
}

export class Combee {
  readonly baseUrl: string;
  readonly stats: TraceStats = {
    queued: 0,
    sent: 0,
    droppedQueueFull: 0,
    rejected: 0,
    lostAtClose: 0,
    retries: 0,
    feedbackSent: 0,
    feedbackDropped: 0,
  };
  readonly #apiKey: string | undefined;
  readonly #fetch: typeof fetch;
  readonly #log: Logger;
  readonly #ttlMs: number;
  readonly #timeoutMs: number;
  readonly #batchSize: number;
  readonly #flushMs: number;
  readonly #maxQueue: number;
  readonly #maxBackoffMs: number;
  readonly #closeMs: number;
  readonly #cache = new Map<string, CacheEntry>();
  readonly #unavailableUntil = new Map<string, number>();
  #traces: PendingTrace[] = [];
  #feedback: PendingFeedback[] = [];
  #oldestAt: number | null = null;
  #inFlight = 0;
  #forcing = 0;
  #running = false;
  #timer: ReturnType<typeof setTimeout> | undefined;
  #closing = false;
  #givenUp = false;
  #warnedFull = false;
  #waiters = new Set<() => void>();
  #onExit: (() => void) | undefined;

  constructor(options: CombeeOptions = {}) {
    const env = nodeProcess?.env ?? {};
    const url = (options.baseUrl ?? env.COMBEE_URL ?? DEFAULT_URL).replace(/\/+$/, '');
    if (!/^https?:\/\//.test(url)) throw new RangeError(`baseUrl must start with http:// or https://, not ${JSON.stringify(url)}`);
    this.baseUrl = url;
    this.#apiKey = options.apiKey ?? env.COMBEE_API_KEY;
    const f = options.fetch ?? globalThis.fetch;
    if (typeof f !== 'function') throw new TypeError('no global fetch: pass `fetch` in the options');
    this.#fetch = f.bind(globalThis);
    this.#log = options.logger ?? console;
    this.#ttlMs = positive('cacheTtl', options.cacheTtl ?? 60) * 1000;
    this.#timeoutMs = positive('timeout', options.timeout ?? 5, 0.001) * 1000;
    this.#batchSize = positive('batchSize', options.batchSize ?? 100, 1);
    if (!Number.isInteger(this.#batchSize) || this.#batchSize > 500) throw new RangeError('batchSize must be a whole number from 1 to 500');
    this.#flushMs = positive('flushInterval', options.flushInterval ?? 1) * 1000;
    this.#maxQueue = positive('maxQueue', options.maxQueue ?? 10_000, 1);
    this.#maxBackoffMs = positive('maxBackoff', options.maxBackoff ?? 30, 0.001) * 1000;
    this.#closeMs = positive('closeTimeout', options.closeTimeout ?? 5) * 1000;
  }

  // ------------------------------------------------------------ prompts

  /**
   * The prompt `name` at `label` (default: the server's `production`).
   * Within `cacheTtl` no request is made; after it the cached prompt is
   * returned at once and revalidated in the background with `If-None-Match`.
   * When the server is unreachable or answers 5xx/408/429: the last known
   * text (`source: "stale"`), else `fallback` (`source: "fallback"`), else
   * `CombeeUnavailable`. A 4xx on a first fetch throws `CombeeAPIError`.
   */
  async getPrompt(name: string, options: GetPromptOptions = {}): Promise<Prompt> {
    if (!name) throw new TypeError('a prompt name is required');
    const { label, subject, fallback } = options;
    const key = JSON.stringify([name, label ?? null, subject ?? null]);
    const entry = this.#cache.get(key);
    const now = Date.now();
    if (entry) {
      if (now >= entry.freshUntil && !entry.revalidating && !this.#givenUp) {
        entry.revalidating = true;
        void this.#revalidate(key, name, label, subject, entry);
      }
      return entry.prompt;
    }
    if (now < (this.#unavailableUntil.get(key) ?? 0)) {
      return this.#cachedOrFallback(key, name, label, subject, fallback, 'it failed moments ago', false);
    }
    let res: Response;
    try {
      res = await this.#request(name, label, subject, null);
    } catch (e) {
      return this.#cachedOrFallback(key, name, label, subject, fallback, errorName(e), true);
    }
    const body = await res.text().catch(() => '');
    if (res.status === 200) {
      try {
        const prompt = parsePrompt(body, label, subject);
        this.#store(key, prompt, res.headers.get('etag'));
        return prompt;
      } catch (e) {
        return this.#cachedOrFallback(key, name, label, subject, fallback, `unreadable answer: ${errorName(e)}`, true);
      }
    }
    if (isUnavailable(res.status)) return this.#cachedOrFallback(key, name, label, subject, fallback, `HTTP ${res.status}`, true);
    throw apiError(res.status, body);
  }

  #request(name: string, label: string | undefined, subject: string | undefined, etag: string | null): Promise<Response> {
    const query = label ? `?label=${encodeURIComponent(label)}` : '';
    const headers: Record<string, string> = this.#headers();
    if (subject !== undefined) headers[SUBJECT_HEADER] = subject;
    if (etag) headers['If-None-Match'] = etag;
    return this.#fetch(`${this.baseUrl}/v1/prompts/${encodeURIComponent(name)}${query}`, {
      headers,
      signal: AbortSignal.timeout(this.#timeoutMs),
    });
  }

  #headers(): Record<string, string> {
    const h: Record<string, string> = { Accept: 'application/json', 'User-Agent': USER_AGENT };
    if (this.#apiKey) h.Authorization = `Bearer ${this.#apiKey}`;
    return h;
  }

  #store(key: string, prompt: Prompt, etag: string | null): void {
    this.#cache.set(key, { prompt, etag, freshUntil: Date.now() + this.#ttlMs, revalidating: false });
    this.#unavailableUntil.delete(key);
  }

  #cachedOrFallback(
    key: string,
    name: string,
    label: string | undefined,
    subject: string | undefined,
    fallback: string | undefined,
    why: string,
    failedNow: boolean,
  ): Prompt {
    // Log the failed request itself, not every call answered in its shadow.
    const warn = failedNow ? (m: string) => this.#log.warn(m) : () => {};
    if (failedNow) this.#unavailableUntil.set(key, Date.now() + UNAVAILABLE_RETRY_MS);
    const entry = this.#cache.get(key);
    if (entry) {
      warn(`combee unavailable (${why}): serving the last known version ${entry.prompt.version} of ${name}`);
      return entry.prompt.withSource('stale');
    }
    if (fallback !== undefined) {
      warn(`combee unavailable (${why}): serving the fallback text for ${name}`);
      return new Prompt(name, fallback, null, label, [], null, 'fallback', null, subject);
    }
    throw new CombeeUnavailable(`cannot get prompt ${JSON.stringify(name)} (${why}); no cached text and no fallback`);
  }

  async #revalidate(key: string, name: string, label: string | undefined, subject: string | undefined, entry: CacheEntry): Promise<void> {
    try {
      const res = await this.#request(name, label, subject, entry.etag);
      const body = await res.text();
      if (res.status === 304) {
        entry.prompt = entry.prompt.withSource('server');
        entry.freshUntil = Date.now() + this.#ttlMs;
        entry.revalidating = false;
        return;
      }
      if (res.status === 200) {
        this.#store(key, parsePrompt(body, label, subject), res.headers.get('etag'));
        return;
      }
      this.#log.warn(`combee: revalidating ${name} answered HTTP ${res.status}; keeping the cached version`);
    } catch (e) {
      this.#log.warn(`combee: revalidating ${name} failed (${errorName(e)}); keeping the cached version`);
    }
    // Keep serving the last known text; ask again after a short pause.
    entry.prompt = entry.prompt.withSource('stale');
    entry.freshUntil = Date.now() + UNAVAILABLE_RETRY_MS;
    entry.revalidating = false;
  }

  // ------------------------------------------------------------ traces

  /**
   * Queues the trace of one run and returns at once; a background sender
   * posts it in a batch. Throws only for a bug at the call site (no input,
   * an unknown feedback field) — never because of the server. When the
   * queue is full the trace is dropped (`handle.status === "dropped"`).
   */
  logTrace(prompt: Prompt | string, trace: TraceInput): TraceHandle {
    const externalId = trace.externalId ?? crypto.randomUUID();
    const body = traceBody(prompt, trace, externalId);
    const handle = new TraceHandle(externalId);
    if (this.#closing) {
      this.#log.warn(`combee client is closed: dropping trace ${externalId}`);
      handle._dropped();
      return handle;
    }
    if (this.#traces.length >= this.#maxQueue) {
      this.stats.droppedQueueFull += 1;
      if (!this.#warnedFull) {
        this.#warnedFull = true;
        this.#log.warn(`combee trace queue is full (${this.#maxQueue} traces): dropping new traces until it drains`);
      }
      handle._dropped();
      return handle;
    }
    this.#warnedFull = false;
    this.#traces.push({ body, handle });
    this.stats.queued += 1;
    this.#oldestAt ??= Date.now();
    this.#watchExit();
    this.#kick();
    return handle;
  }

  /**
   * Records one run of `fn` as a trace: `run.step(…)` appends to its
   * trajectory, `run.feedback(…)` sets feedback, and what `fn` returns is the
   * output (unless `run.output` was set). An error thrown by `fn` is recorded
   * (`feedback.error`, `success: false` unless set) and thrown again. The
   * trace is queued when `fn` settles; its handle is `run.handle`.
   */
  async trace<T>(prompt: Prompt | string, input: unknown, fn: (run: Run) => T | Promise<T>, metadata?: Record<string, unknown>): Promise<T> {
    const run = new Run();
    try {
      const result = await fn(run);
      if (run.output === undefined) run.output = result;
      return result;
    } catch (e) {
      const message = e instanceof Error ? `${e.name}: ${e.message}` : String(e);
      run.feedback({ error: message.slice(0, 4000), ...run.feedbackSoFar, success: run.feedbackSoFar.success ?? false });
      throw e;
    } finally {
      run.handle = this.logTrace(prompt, {
        input: input ?? {},
        output: run.output,
        trajectory: run.trajectory.length ? run.trajectory : undefined,
        feedback: Object.keys(run.feedbackSoFar).length ? run.feedbackSoFar : undefined,
        metadata,
      });
    }
  }

  /**
   * Late feedback on a trace: by its handle (sent once the trace is stored,
   * even if that is later) or by its server id. Fields given replace earlier ones.
   */
  feedback(target: TraceHandle | string, feedback: Feedback): void {
    const body = feedbackBody(feedback);
    if (this.#closing || this.#feedback.length >= this.#maxQueue) {
      this.stats.feedbackDropped += 1;
      this.#log.warn('combee: dropping feedback (the client is closed or its queue is full)');
      return;
    }
    this.#feedback.push({ target, body });
    this.#watchExit();
    this.#kick();
  }

  /** Sends everything queued now and waits (up to `timeout` seconds) until it is stored or refused; `false` when time ran out. */
  async flush(timeout?: number): Promise<boolean> {
    this.#forcing += 1;
    try {
      this.#kick();
      return await this.#until(() => this.#idle(), timeout === undefined ? undefined : timeout * 1000);
    } finally {
      this.#forcing -= 1;
    }
  }

  /**
   * Flushes for up to `timeout` seconds (default `closeTimeout`), then stops;
   * whatever is still queued is dropped and counted in `stats.lostAtClose`.
   */
  async close(timeout?: number): Promise<void> {
    this.#closing = true;
    const done = await this.flush(timeout ?? this.#closeMs / 1000);
    this.#givenUp = true;
    if (!done) {
      const lost = this.#traces.length;
      for (const t of this.#traces) t.handle._dropped();
      this.#traces = [];
      this.stats.lostAtClose += lost;
      this.stats.feedbackDropped += this.#feedback.length;
      this.#feedback = [];
      if (lost) this.#log.error(`combee: ${lost} trace(s) were still queued at close and are lost`);
    }
    if (this.#timer !== undefined) clearTimeout(this.#timer);
    if (this.#onExit) nodeProcess?.off?.('beforeExit', this.#onExit);
    this.#onExit = undefined;
    this.#notify();
  }

  /** On Node.js: flush (bounded by `closeTimeout`) when the event loop runs dry, as a process is about to exit. */
  #watchExit(): void {
    if (this.#onExit || !nodeProcess?.once) return;
    this.#onExit = () => {
      this.#onExit = undefined;
      if (!this.#idle() && !this.#closing) void this.close();
    };
    nodeProcess.once('beforeExit', this.#onExit);
  }

  #idle(): boolean {
    return this.#traces.length === 0 && this.#feedback.length === 0 && this.#inFlight === 0;
  }

  #notify(): void {
    for (const w of [...this.#waiters]) w();
  }

  /** Resolves `true` once `done()` holds, `false` at the deadline. */
  #until(done: () => boolean, ms: number | undefined): Promise<boolean> {
    if (done()) return Promise.resolve(true);
    return new Promise((resolve) => {
      let timer: ReturnType<typeof setTimeout> | undefined;
      const check = () => {
        if (!done()) return;
        finish(true);
      };
      const finish = (value: boolean) => {
        this.#waiters.delete(check);
        if (timer !== undefined) clearTimeout(timer);
        resolve(value);
      };
      this.#waiters.add(check);
      // This timer keeps a Node.js process alive while it waits, on purpose.
      if (ms !== undefined) timer = setTimeout(() => finish(done()), ms);
    });
  }

  /** Starts the sender unless it runs; it stops when nothing is due and sets a timer for what will be. */
  #kick(): void {
    if (this.#running || this.#givenUp) return;
    if (this.#timer !== undefined) {
      clearTimeout(this.#timer);
      this.#timer = undefined;
    }
    this.#running = true;
    void this.#run().finally(() => {
      this.#running = false;
      this.#notify();
      if (this.#givenUp) return;
      if (this.#due()) this.#kick();
      else if (this.#oldestAt !== null) {
        const wait = Math.max(0, this.#flushMs - (Date.now() - this.#oldestAt));
        this.#timer = setTimeout(() => {
          this.#timer = undefined;
          this.#kick();
        }, wait);
        (this.#timer as unknown as { unref?(): void }).unref?.();
      }
    });
  }

  async #run(): Promise<void> {
    for (;;) {
      const work = this.#take();
      if (work === null) return;
      this.#inFlight += 1;
      try {
        if (work instanceof Batch) await this.#sendBatch(work);
        else await this.#sendFeedback(work);
      } catch (e) {
        this.#log.error(`combee trace sender failed (${errorName(e)}); continuing`);
      } finally {
        this.#inFlight -= 1;
        this.#notify();
      }
    }
  }

  /** Whether queued traces are due (a full batch, the oldest waited long enough, or a flush). */
  #tracesDue(): boolean {
    if (!this.#traces.length) return false;
    const force = this.#forcing > 0 || this.#closing;
    const aged = this.#oldestAt !== null && Date.now() - this.#oldestAt >= this.#flushMs;
    return force || aged || this.#traces.length >= this.#batchSize;
  }

  /** Feedback whose trace has its id now (feedback for a dropped trace is dropped too). */
  #readyFeedback(): PendingFeedback[] {
    const ready: PendingFeedback[] = [];
    const waiting: PendingFeedback[] = [];
    for (const f of this.#feedback) {
      if (typeof f.target === 'string' || f.target.id !== null) ready.push(f);
      else if (f.target.status === 'dropped') {
        this.stats.feedbackDropped += 1;
        this.#log.warn(`combee: dropping feedback for trace ${f.target.externalId}: the trace was dropped`);
      } else waiting.push(f);
    }
    this.#feedback = waiting;
    return ready;
  }

  #due(): boolean {
    return this.#tracesDue() || this.#feedback.some((f) => typeof f.target === 'string' || f.target.status !== 'queued');
  }

  /** The work due now, if any. */
  #take(): Batch | PendingFeedback[] | null {
    if (this.#tracesDue()) {
      const batch = new Batch(this.#traces.splice(0, this.#batchSize));
      this.#oldestAt = this.#traces.length ? Date.now() : null;
      return batch;
    }
    const ready = this.#readyFeedback();
    return ready.length ? ready : null;
  }

  async #post(path: string, body: string, extra: Record<string, string>): Promise<{ status: number; text: string }> {
    const res = await this.#fetch(`${this.baseUrl}${path}`, {
      method: 'POST',
      headers: { ...this.#headers(), 'Content-Type': 'application/json', ...extra },
      body,
      signal: AbortSignal.timeout(this.#timeoutMs),
    });
    return { status: res.status, text: await res.text() };
  }

  /** Sends one batch until it is stored or refused (or the client gave up), every retry with the same key. */
  async #sendBatch(first: Batch): Promise<void> {
    const queue = [first];
    while (queue.length) {
      if (this.#givenUp) {
        for (const t of queue.flatMap((b) => b.traces)) t.handle._dropped();
        return;
      }
      const b = queue[0]!;
      let outcome: Outcome;
      try {
        const res = await this.#post('/v1/traces', b.payload(), { 'Idempotency-Key': b.key });
        outcome = batchOutcome(res.status, res.text, b.traces.length);
      } catch (e) {
        outcome = { kind: 'retry', reason: errorName(e) };
      }
      queue.shift();
      switch (outcome.kind) {
        case 'stored':
          b.traces.forEach((t, i) => t.handle._stored(outcome.ids[i]!));
          this.stats.sent += b.traces.length;
          break;
        case 'retry':
          b.attempts += 1;
          this.stats.retries += 1;
          queue.unshift(b);
          await sleep(backoffMs(b.attempts, this.#maxBackoffMs), this.#forcing > 0);
          break;
        case 'drop-one': {
          const bad = b.traces[outcome.index]!;
          this.#log.error(`combee rejected trace ${bad.handle.externalId}, dropping it: ${outcome.reason}`);
          bad.handle._dropped();
          this.stats.rejected += 1;
          const rest = b.traces.filter((_, i) => i !== outcome.index);
          if (rest.length) queue.unshift(new Batch(rest));
          break;
        }
        case 'split': {
          const mid = Math.floor(b.traces.length / 2);
          queue.unshift(new Batch(b.traces.slice(0, mid)), new Batch(b.traces.slice(mid)));
          break;
        }
        case 'drop-all':
          this.#log.error(`combee refused a batch of ${b.traces.length} traces, dropping it: ${outcome.reason}`);
          for (const t of b.traces) t.handle._dropped();
          this.stats.rejected += b.traces.length;
          break;
      }
    }
  }

  async #sendFeedback(items: PendingFeedback[]): Promise<void> {
    const retry: PendingFeedback[] = [];
    for (const f of items) {
      const id = typeof f.target === 'string' ? f.target : f.target.id!;
      try {
        const res = await this.#post(`/v1/traces/${encodeURIComponent(id)}/feedback`, JSON.stringify(f.body), {});
        if (res.status === 200) this.stats.feedbackSent += 1;
        else if (isUnavailable(res.status)) retry.push(f);
        else {
          this.stats.feedbackDropped += 1;
          this.#log.error(`combee refused feedback for trace ${id}: ${apiError(res.status, res.text).message}`);
        }
      } catch {
        retry.push(f);
      }
    }
    if (retry.length) {
      this.#feedback.unshift(...retry);
      this.stats.retries += 1;
      await sleep(backoffMs(1, this.#maxBackoffMs), this.#forcing > 0);
    }
  }
}

/** One run being recorded by `client.trace`. */
export class Run {
  /** The output; defaults to what the recorded function returns. */
  output: unknown = undefined;
  readonly trajectory: unknown[] = [];
  /** The queued trace, once the run has ended. */
  handle: TraceHandle | null = null;
  #feedback: Feedback = {};

  /** Appends one message, step or tool call to the trajectory. */
  step(item: unknown): void {
    this.trajectory.push(item);
  }

  /** Sets feedback fields (`score`, `success`, `groundTruth`, `comment`, `error`). */
  feedback(fields: Feedback): void {
    feedbackBody(fields); // refuses unknown fields here, at the call site
    this.#feedback = { ...this.#feedback, ...fields };
  }

  get feedbackSoFar(): Feedback {
    return { ...this.#feedback };
  }
}

function errorName(e: unknown): string {
  if (e instanceof Error) return e.name === 'Error' ? e.message : e.name;
  return String(e);
}

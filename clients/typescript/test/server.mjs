// The real combee server for the client's tests: the binary at $COMBEE_BIN
// (default target/debug/combee; this builds nothing), on a free loopback
// port with a temporary SQLite store, ready once /readyz says so. `stop()`
// and `start()` again reuse the same port and store.
import { spawn } from 'node:child_process';
import { existsSync, mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { createServer } from 'node:net';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';

const REPO = resolve(import.meta.dirname, '..', '..', '..');

export async function freePort() {
  const srv = createServer();
  await new Promise((ok) => srv.listen(0, '127.0.0.1', ok));
  const { port } = srv.address();
  await new Promise((ok) => srv.close(ok));
  return port;
}

export class CombeeServer {
  static async start() {
    const server = new CombeeServer(mkdtempSync(join(tmpdir(), 'combee-ts-')), await freePort());
    await server.start();
    return server;
  }

  constructor(dir, port) {
    this.dir = dir;
    this.port = port;
    this.url = `http://127.0.0.1:${port}`;
    this.binary = process.env.COMBEE_BIN ?? join(REPO, 'target', 'debug', 'combee');
    if (!existsSync(this.binary)) throw new Error(`no combee binary at ${this.binary}: run scripts/test-typescript or set COMBEE_BIN`);
  }

  async start() {
    const env = Object.fromEntries(Object.entries(process.env).filter(([k]) => !k.startsWith('COMBEE') && k !== 'DATABASE_URL'));
    Object.assign(env, {
      COMBEE__DATABASE__DATA_DIR: this.dir,
      COMBEE_CONFIG_DIR: join(this.dir, 'no-config'),
      COMBEE__LOG__LEVEL: 'warn',
    });
    this.proc = spawn(this.binary, ['serve', '--bind', `127.0.0.1:${this.port}`, '--role', 'api'], { env, cwd: this.dir, stdio: 'ignore' });
    const deadline = Date.now() + 30_000;
    for (;;) {
      if (this.proc.exitCode !== null) throw new Error(`combee exited with ${this.proc.exitCode}`);
      try {
        if ((await fetch(`${this.url}/readyz`)).ok) break;
      } catch {
        // not listening yet
      }
      if (Date.now() > deadline) throw new Error('combee did not become ready');
      await sleep(20);
    }
    this.adminKey = readFileSync(join(this.dir, 'admin-key'), 'utf8').trim();
  }

  async stop() {
    if (!this.proc || this.proc.exitCode !== null) return;
    const exited = new Promise((ok) => this.proc.once('exit', ok));
    this.proc.kill('SIGTERM');
    await exited;
  }

  async dispose() {
    await this.stop();
    rmSync(this.dir, { recursive: true, force: true });
  }

  /** A request with the admin key (for setting up and checking). */
  async api(method, path, body) {
    const res = await fetch(this.url + path, {
      method,
      headers: { authorization: `Bearer ${this.adminKey}`, 'content-type': 'application/json' },
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    const text = await res.text();
    return { status: res.status, body: text ? JSON.parse(text) : null };
  }

  async createPrompt(name, base) {
    const res = await this.api('POST', '/v1/prompts', { name, base, promotion: 'manual' });
    if (res.status !== 201) throw new Error(JSON.stringify(res.body));
  }

  async newProductionVersion(name, base) {
    const res = await this.api('POST', `/v1/prompts/${name}/versions`, { base, labels: ['production'] });
    if (res.status !== 201) throw new Error(JSON.stringify(res.body));
    return res.body.number;
  }

  async traces(prompt) {
    const res = await this.api('GET', `/v1/traces?prompt=${prompt}&page_size=200`);
    return res.body.traces;
  }
}

/** A `fetch` that records every request (method, path, headers) and its status. */
export function recordingFetch() {
  const log = [];
  const f = async (url, init = {}) => {
    const entry = { method: init.method ?? 'GET', path: new URL(url).pathname, headers: { ...(init.headers ?? {}) }, status: null };
    log.push(entry);
    const res = await fetch(url, init);
    entry.status = res.status;
    return res;
  };
  f.log = log;
  f.matching = (method, prefix) => log.filter((e) => e.method === method && e.path.startsWith(prefix));
  return f;
}

/** Polls `check` until it is truthy (the client works in the background). */
export async function eventually(check, what, ms = 10_000) {
  const deadline = Date.now() + ms;
  for (;;) {
    const v = await check();
    if (v) return v;
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await sleep(10);
  }
}

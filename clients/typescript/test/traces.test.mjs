// Traces against the real server: batches with the prompt's version, late
// feedback by handle, a restart in the middle (nothing lost, nothing stored
// twice), a rejected trace, a full queue, and the flush at process exit (from
// a CommonJS program, so the CommonJS build is exercised too).
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { resolve } from 'node:path';
import { after, before, test } from 'node:test';

import { Combee } from '../dist/esm/index.js';
import { CombeeServer, eventually, recordingFetch } from './server.mjs';

let server;
before(async () => {
  server = await CombeeServer.start();
  await server.createPrompt('agent', 'You are an agent.');
});
after(() => server.dispose());

const quiet = { warn() {}, error() {} };

test('traces go in batches with the version they ran with, and late feedback follows', async () => {
  const f = recordingFetch();
  const client = new Combee({ baseUrl: server.url, apiKey: server.adminKey, fetch: f, batchSize: 3, logger: quiet });
  const prompt = await client.getPrompt('agent');
  const handles = Array.from({ length: 7 }, (_, i) =>
    client.logTrace(prompt, { input: { q: `batched ${i}` }, output: `a${i}`, feedback: { success: i % 2 === 0 } }),
  );
  assert.ok(handles.every((h) => h.status === 'queued' && h.id === null && h.externalId));
  client.feedback(handles[0], { score: 0.25, comment: 'late' }); // before the trace is stored
  assert.equal(await client.flush(10), true);
  const posts = f.matching('POST', '/v1/traces');
  assert.deepEqual(posts.filter((p) => p.path === '/v1/traces').map((p) => p.status), [201, 201, 201]);
  assert.ok(posts.every((p) => p.path !== '/v1/traces' || p.headers['Idempotency-Key'].startsWith('combee-ts-')));
  assert.ok(handles.every((h) => h.status === 'stored' && h.id));
  const stored = (await server.traces('agent')).filter((t) => JSON.stringify(t.input).includes('batched'));
  assert.equal(stored.length, 7);
  assert.ok(stored.every((t) => t.prompt_version === 1));
  const first = stored.find((t) => t.id === handles[0].id);
  assert.deepEqual(first.feedback, { success: true, score: 0.25, comment: 'late' });
  assert.equal(first.external_id, handles[0].externalId);
  assert.equal(client.stats.sent, 7);
  assert.equal(client.stats.feedbackSent, 1);
  await client.close();
});

test('a server restart in the middle loses nothing and stores nothing twice', async () => {
  const other = await CombeeServer.start();
  try {
    await other.createPrompt('agent', 'You are an agent.');
    const f = recordingFetch();
    const client = new Combee({ baseUrl: other.url, apiKey: other.adminKey, fetch: f, batchSize: 5, maxBackoff: 0.2, timeout: 2, logger: quiet });
    await other.stop();
    const handles = Array.from({ length: 5 }, (_, i) => client.logTrace('agent', { input: `restart ${i}` }));
    await eventually(() => client.stats.retries >= 2, 'retries while the server is down');
    await other.start();
    assert.equal(await client.flush(15), true);
    const stored = await other.traces('agent');
    assert.equal(stored.length, 5, 'each once');
    assert.deepEqual(new Set(stored.map((t) => t.id)), new Set(handles.map((h) => h.id)));
    const keys = new Set(f.matching('POST', '/v1/traces').map((p) => p.headers['Idempotency-Key']));
    assert.equal(keys.size, 1, 'every retry of the batch carried its key');
    await client.close();
  } finally {
    await other.dispose();
  }
});

test('a rejected trace does not take its batch down; bad calls fail at the call site', async () => {
  const client = new Combee({ baseUrl: server.url, apiKey: server.adminKey, batchSize: 10, logger: quiet });
  const good = client.logTrace('agent', { input: 'kept 1' });
  const bad = client.logTrace('no-such-prompt', { input: 'refused' });
  const also = client.logTrace('agent', { input: 'kept 2' });
  await client.flush(10);
  assert.deepEqual([good.status, bad.status, also.status], ['stored', 'dropped', 'stored']);
  assert.equal(client.stats.rejected, 1);
  assert.throws(() => client.logTrace('agent', { input: null }), TypeError);
  assert.throws(() => client.logTrace('agent', { input: 1, feedback: { stars: 5 } }), TypeError);
  const odd = client.logTrace('agent', { input: { n: Number.NaN, big: 10n } }); // JSON cannot carry these
  await client.flush(10);
  assert.equal(odd.status, 'stored');
  await client.close();
});

test('client.trace records a run, its steps and a thrown error', async () => {
  const client = new Combee({ baseUrl: server.url, apiKey: server.adminKey, logger: quiet });
  const prompt = await client.getPrompt('agent');
  let ok;
  const answer = await client.trace(prompt, { q: 'traced run' }, (run) => {
    ok = run;
    run.step({ role: 'tool', content: 'looked it up' });
    run.feedback({ success: true });
    return 'found it';
  });
  assert.equal(answer, 'found it');
  let failed;
  await assert.rejects(
    client.trace('agent', { q: 'traced failure' }, async (run) => {
      failed = run;
      throw new RangeError('no such order');
    }),
    RangeError,
  );
  assert.throws(() => ok.feedback({ stars: 1 }), TypeError);
  await client.flush(10);
  const stored = await server.traces('agent');
  const good = stored.find((t) => t.id === ok.handle.id);
  assert.deepEqual([good.output, good.trajectory, good.feedback, good.prompt_version], ['found it', [{ role: 'tool', content: 'looked it up' }], { success: true }, 1]);
  const bad = stored.find((t) => t.id === failed.handle.id);
  assert.deepEqual(bad.feedback, { success: false, error: 'RangeError: no such order' });
  await client.close();
});

test('a full queue drops new traces and never blocks', () => {
  const client = new Combee({ baseUrl: 'http://127.0.0.1:9', maxQueue: 2, flushInterval: 3600, logger: quiet });
  const handles = Array.from({ length: 4 }, (_, i) => client.logTrace('agent', { input: i }));
  assert.deepEqual(handles.map((h) => h.status), ['queued', 'queued', 'dropped', 'dropped']);
  assert.equal(client.stats.droppedQueueFull, 2);
  return client.close(0);
});

test('queued traces are sent when the process exits (a CommonJS program)', async () => {
  const program = `
    const { Combee } = require(${JSON.stringify(resolve(import.meta.dirname, '..', 'dist', 'cjs', 'index.js'))});
    const client = new Combee({ flushInterval: 3600 });
    for (let i = 0; i < 3; i++) client.logTrace('agent', { input: 'at exit ' + i });
  `;
  execFileSync(process.execPath, ['-e', program], {
    env: { ...process.env, COMBEE_URL: server.url, COMBEE_API_KEY: server.adminKey },
    timeout: 30_000,
  });
  const stored = (await server.traces('agent')).filter((t) => String(t.input).startsWith('at exit'));
  assert.equal(stored.length, 3);
});

test("two projects' prompts of one name: each key reaches its own, and traces land there", async () => {
  const s = await CombeeServer.start();
  try {
    for (const project of ['team-a', 'team-b']) {
      assert.equal((await s.api('POST', '/v1/projects', { name: project })).status, 201);
      const made = await s.api('POST', '/v1/prompts', { name: 'support-agent', base: `You help ${project}.`, project });
      assert.equal(made.status, 201);
    }
    const key = await s.api('POST', '/v1/keys', { name: 'a', scopes: ['prompts:read', 'traces:write'], project: 'team-a' });
    // A project's key names its prompt bare; the served name is the one any key writes back.
    const mine = new Combee({ baseUrl: s.url, apiKey: key.body.secret, logger: quiet });
    const a = await mine.getPrompt('support-agent');
    assert.deepEqual([a.name, a.text], ['team-a/support-agent', 'You help team-a.']);
    mine.logTrace(a, { input: { q: 'from a' }, output: 'ok' });
    assert.equal(await mine.flush(10), true);
    await mine.close();
    // A server-wide key writes `team-b/support-agent` (the client encodes the `/`).
    const all = new Combee({ baseUrl: s.url, apiKey: s.adminKey, logger: quiet });
    const b = await all.getPrompt('team-b/support-agent');
    assert.deepEqual([b.name, b.text], ['team-b/support-agent', 'You help team-b.']);
    all.logTrace(b, { input: { q: 'from the server-wide key' }, output: 'ok' });
    assert.equal(await all.flush(10), true);
    await all.close();
    assert.deepEqual((await s.traces('team-a/support-agent')).map((t) => t.input), [{ q: 'from a' }]);
    assert.deepEqual((await s.traces('team-b/support-agent')).map((t) => t.input), [{ q: 'from the server-wide key' }]);
  } finally {
    await s.dispose();
  }
});

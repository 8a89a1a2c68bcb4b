// Prompts against the real server: the cache, ETag revalidation, the last
// known text and the fallback when the server is down, subjects, refusals.
import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';

import { Combee, CombeeAPIError, CombeeUnavailable, MissingVariable } from '../dist/esm/index.js';
import { CombeeServer, eventually, freePort, recordingFetch } from './server.mjs';

let server;
before(async () => {
  server = await CombeeServer.start();
  await server.createPrompt('support', 'You help with {product}.');
});
after(() => server.dispose());

const quiet = { warn() {}, error() {} };

test('a cache hit makes no request; a stale prompt is revalidated with its ETag', async () => {
  const f = recordingFetch();
  const client = new Combee({ baseUrl: server.url, apiKey: server.adminKey, fetch: f, cacheTtl: 60, logger: quiet });
  const first = await client.getPrompt('support');
  assert.equal(first.version, 1);
  assert.equal(first.source, 'server');
  assert.deepEqual(first.labels, ['production']);
  assert.equal(first.compile({ product: 'Acme' }), 'You help with Acme.');
  assert.throws(() => first.compile(), MissingVariable);
  await client.getPrompt('support');
  assert.equal(f.matching('GET', '/v1/prompts/').length, 1, 'within the TTL: no request');

  const stale = new Combee({ baseUrl: server.url, apiKey: server.adminKey, fetch: f, cacheTtl: 0, logger: quiet });
  await stale.getPrompt('support');
  const before = f.log.length;
  const served = await stale.getPrompt('support'); // at once, from the cache
  assert.equal(served.version, 1);
  const revalidation = await eventually(() => f.log.slice(before).find((e) => e.status !== null), 'the revalidation');
  assert.match(revalidation.headers['If-None-Match'], /^"v1-/);
  assert.equal(revalidation.status, 304);

  // A new production version reaches the agent after the next revalidation.
  await server.newProductionVersion('support', 'You help with {product}. Be brief.');
  await eventually(async () => (await stale.getPrompt('support')).version === 2, 'version 2');
});

test('subjects are sent and cached apart', async () => {
  const f = recordingFetch();
  const client = new Combee({ baseUrl: server.url, apiKey: server.adminKey, fetch: f, logger: quiet });
  const a = await client.getPrompt('support', { subject: 'user-a' });
  await client.getPrompt('support', { subject: 'user-b' });
  await client.getPrompt('support', { subject: 'user-a' });
  const sent = f.matching('GET', '/v1/prompts/').map((e) => e.headers['Combee-Subject']);
  assert.deepEqual(sent, ['user-a', 'user-b']);
  assert.equal(a.subject, 'user-a');
});

test('refusals throw even with a fallback; labels are asked for by name', async () => {
  const client = new Combee({ baseUrl: server.url, apiKey: server.adminKey, logger: quiet });
  await assert.rejects(client.getPrompt('no-such-prompt', { fallback: 'x' }), (e) => e instanceof CombeeAPIError && e.status === 404);
  await assert.rejects(client.getPrompt('support', { label: 'nowhere' }), (e) => e instanceof CombeeAPIError && e.status === 404);
  const latest = await client.getPrompt('support', { label: 'latest' });
  assert.equal(latest.label, 'latest');
  const badKey = new Combee({ baseUrl: server.url, apiKey: 'cmb_wrong', logger: quiet });
  await assert.rejects(badKey.getPrompt('support'), (e) => e instanceof CombeeAPIError && e.status === 401);
});

test('the server down: the last known text, else the fallback, else CombeeUnavailable', async () => {
  const other = await CombeeServer.start();
  try {
    await other.createPrompt('support', 'You help.');
    const warnings = [];
    const client = new Combee({ baseUrl: other.url, apiKey: other.adminKey, cacheTtl: 0, timeout: 2, logger: { warn: (m) => warnings.push(m), error() {} } });
    assert.equal((await client.getPrompt('support')).source, 'server');
    await other.stop();
    await client.getPrompt('support'); // starts a revalidation that fails
    const stale = await eventually(async () => {
      const p = await client.getPrompt('support');
      return p.source === 'stale' && p;
    }, 'the stale prompt');
    assert.equal(stale.text, 'You help.');
    assert.ok(warnings.some((w) => w.includes('keeping the cached version')), warnings.join('\n'));
  } finally {
    await other.dispose();
  }
  const nowhere = `http://127.0.0.1:${await freePort()}`;
  const client = new Combee({ baseUrl: nowhere, apiKey: 'cmb_x', logger: quiet });
  const fallback = await client.getPrompt('support', { fallback: 'You are a support agent.' });
  assert.deepEqual([fallback.source, fallback.version, fallback.text], ['fallback', null, 'You are a support agent.']);
  await assert.rejects(new Combee({ baseUrl: nowhere, logger: quiet }).getPrompt('support'), CombeeUnavailable);
});

test('bad settings fail at construction', () => {
  assert.throws(() => new Combee({ baseUrl: 'ftp://x' }), RangeError);
  assert.throws(() => new Combee({ batchSize: 501 }), RangeError);
  assert.throws(() => new Combee({ timeout: 0 }), RangeError);
});

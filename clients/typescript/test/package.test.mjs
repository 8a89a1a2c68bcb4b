// The package as published: no runtime dependencies, nothing from Node.js in
// the library (so it runs on edge runtimes), and both builds load.
import assert from 'node:assert/strict';
import { readFileSync, readdirSync } from 'node:fs';
import { createRequire } from 'node:module';
import { join, resolve } from 'node:path';
import { test } from 'node:test';

const root = resolve(import.meta.dirname, '..');

test('no runtime dependencies, and the library imports only its own files', () => {
  const pkg = JSON.parse(readFileSync(join(root, 'package.json'), 'utf8'));
  assert.equal(pkg.dependencies, undefined);
  for (const build of ['esm', 'cjs']) {
    for (const file of readdirSync(join(root, 'dist', build)).filter((f) => f.endsWith('.js'))) {
      const text = readFileSync(join(root, 'dist', build, file), 'utf8');
      const imports = [...text.matchAll(/(?:from\s+|require\()\s*['"]([^'"]+)['"]/g)].map((m) => m[1]);
      assert.ok(imports.every((i) => i.startsWith('./')), `${build}/${file} imports ${imports}`);
    }
  }
});

test('the ESM and CommonJS builds export the same API', async () => {
  const esm = await import('../dist/esm/index.js');
  const cjs = createRequire(import.meta.url)('../dist/cjs/index.js');
  assert.deepEqual(Object.keys(cjs).sort(), Object.keys(esm).sort());
  assert.equal(typeof cjs.Combee, 'function');
});

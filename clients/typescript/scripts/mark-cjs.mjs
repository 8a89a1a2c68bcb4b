// Marks dist/cjs as CommonJS (the package itself is ESM), so Node.js loads
// `require('@combee/client')` from the CommonJS build.
import { writeFileSync } from 'node:fs';
writeFileSync(new URL('../dist/cjs/package.json', import.meta.url), '{"type": "commonjs"}\n');

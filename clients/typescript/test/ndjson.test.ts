/** The NDJSON splitter on its own: every way a body can be cut into chunks gives the same lines. */
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';

import { lines } from '../src/ndjson.js';

async function* chunks(parts: Buffer[]): AsyncGenerator<Buffer> {
  for (const p of parts) yield p;
}

async function collect(parts: Buffer[], max?: number): Promise<string[]> {
  const out: string[] = [];
  for await (const l of lines(chunks(parts), max)) out.push(l.toString('utf8'));
  return out;
}

const BODY = Buffer.from(
  '{"stdout":"aGkK"}\n{"stderr":"b29wcwo="}\n\n{"error":"caf\u00e9 \u2603 \ud83d\ude00","code":"internal"}\n{"exit_code":5,"signal":null,"timed_out":false,"duration_ms":41}\n',
  'utf8',
);
const EXPECTED = BODY.toString('utf8').split('\n').slice(0, -1);

describe('ndjson lines', () => {
  it('gives the same lines for every cut of the body into two and three chunks', async () => {
    for (let i = 0; i <= BODY.length; i++) {
      assert.deepEqual(await collect([BODY.subarray(0, i), BODY.subarray(i)]), EXPECTED, `cut at ${i}`);
    }
    for (let i = 0; i <= BODY.length; i += 3) {
      for (let j = i; j <= BODY.length; j += 5) {
        assert.deepEqual(await collect([BODY.subarray(0, i), BODY.subarray(i, j), BODY.subarray(j)]), EXPECTED, `cuts at ${i}, ${j}`);
      }
    }
  });

  it('gives the same lines one byte at a time (a multi-byte character split too)', async () => {
    const bytes = [...BODY].map((b) => Buffer.from([b]));
    assert.deepEqual(await collect(bytes), EXPECTED);
  });

  it('yields a last line without a newline, and drops a CR before a newline', async () => {
    assert.deepEqual(await collect([Buffer.from('{"a":1}\r\n{"b":'), Buffer.from('2}')]), ['{"a":1}', '{"b":2}']);
  });

  it('refuses a line longer than the bound, whether it ends or not', async () => {
    await assert.rejects(collect([Buffer.alloc(40, 0x61), Buffer.from('\n')], 32), RangeError);
    await assert.rejects(collect([Buffer.alloc(20, 0x61), Buffer.alloc(20, 0x61)], 32), RangeError);
  });
});

/**
 * The exec stream over real sockets: lines cut at awkward places, the request's shape, the last
 * line's errors, a stream cut short, backpressure, abort and an early exit from the loop.
 */
import assert from 'node:assert/strict';
import type http from 'node:http';
import { after, before, describe, it } from 'node:test';
import { setTimeout as sleep } from 'node:timers/promises';

import { BadRequestError, HostRestartingError, StreamCutError, VmDiedError, type OutputChunk } from '../src/index.js';
import { FakeHost, readAll } from './fake-host.js';

const EXEC = 'POST /v1/sandboxes/sbx-1/exec';
const b64 = (s: string | Buffer): string => Buffer.from(s).toString('base64');

function ndjsonHead(res: http.ServerResponse): void {
  res.writeHead(200, { 'content-type': 'application/x-ndjson' });
  res.flushHeaders();
}

/** Waits until the response takes more, or closes; its listeners go either way. */
function drainOrClose(res: http.ServerResponse): Promise<void> {
  return new Promise((resolve) => {
    const done = (): void => {
      res.off('drain', done);
      res.off('close', done);
      resolve();
    };
    res.on('drain', done);
    res.on('close', done);
  });
}

/** Writes `body` in pieces of `size` bytes, each on its own after a pause (so each goes in its own segment). */
async function writeInPieces(res: http.ServerResponse, body: Buffer, size: number): Promise<void> {
  for (let i = 0; i < body.length; i += size) {
    res.write(body.subarray(i, i + size));
    await sleep(1);
  }
}

describe('exec', () => {
  let host: FakeHost;
  before(async () => {
    host = await new FakeHost().listen();
  });
  after(async () => host.close());

  it('sends the request as docs/api.md writes it', async () => {
    let body: unknown;
    host.on(EXEC, async (req, res) => {
      assert.equal(req.headers['content-type'], 'application/json');
      body = JSON.parse((await readAll(req)).toString('utf8'));
      ndjsonHead(res);
      res.end('{"exit_code":0,"signal":null,"timed_out":false,"duration_ms":3}\n');
    });
    const sb = host.client().sandbox('sbx-1');
    const ex = await sb.exec(['npm', 'test'], { cwd: '/workspace/app', env: { CI: '1' }, timeoutMs: 600000, stdin: 'hello\n' });
    assert.deepEqual(await ex.wait(), { exit_code: 0, signal: null, timed_out: false, duration_ms: 3 });
    assert.deepEqual(body, { argv: ['npm', 'test'], cwd: '/workspace/app', env: { CI: '1' }, timeout_ms: 600000, stdin: b64('hello\n') });
    await (await sb.exec('npm ci && npm test')).wait();
    assert.deepEqual(body, { command: 'npm ci && npm test' });
  });

  for (const size of [1, 2, 3, 5, 7, 13]) {
    it(`reads output and exit with the body written ${size} byte(s) at a time`, async () => {
      const lines = [
        { stdout: b64('line one\n') },
        { stderr: b64('oops\n') },
        { stdout: b64(Buffer.from([0, 255, 10, 13, 200])) },
        { exit_code: 5, signal: null, timed_out: false, duration_ms: 41 },
      ];
      host.on(EXEC, async (req, res) => {
        await readAll(req);
        ndjsonHead(res);
        await writeInPieces(res, Buffer.from(lines.map((l) => JSON.stringify(l) + '\n').join('')), size);
        res.end();
      });
      const ex = await host.client().sandbox('sbx-1').exec('x');
      const got: OutputChunk[] = [];
      for await (const chunk of ex) got.push(chunk);
      assert.deepEqual(
        got.map((c) => [c.stream, [...c.data]]),
        [
          ['stdout', [...Buffer.from('line one\n')]],
          ['stderr', [...Buffer.from('oops\n')]],
          ['stdout', [0, 255, 10, 13, 200]],
        ],
      );
      assert.deepEqual(await ex.wait(), { exit_code: 5, signal: null, timed_out: false, duration_ms: 41 });
    });
  }

  it('collect() keeps the output; a command killed by its own timeout is a status, not an error', async () => {
    host.on(EXEC, async (req, res) => {
      await readAll(req);
      ndjsonHead(res);
      res.write(`{"stdout":"${b64('a')}"}\n{"stdout":"${b64('b')}"}\n{"stderr":"${b64('c')}"}\n`);
      res.end('{"exit_code":null,"signal":9,"timed_out":true,"duration_ms":1000}\n');
    });
    const r = await (await host.client().sandbox('sbx-1').exec('sleep 9', { timeoutMs: 1000 })).collect();
    assert.equal(r.stdout.toString(), 'ab');
    assert.equal(r.stderr.toString(), 'c');
    assert.deepEqual(r.exit, { exit_code: null, signal: 9, timed_out: true, duration_ms: 1000 });
  });

  it('throws the last line’s error: bad_request (cannot start), vm_died (midway), host_restarting', async () => {
    host.on(EXEC, async (req, res) => {
      await readAll(req);
      ndjsonHead(res);
      res.end('{"error":"spawn failed: no such program `nope`","code":"bad_request"}\n');
    });
    const ex = await host.client().sandbox('sbx-1').exec(['nope']);
    await assert.rejects(ex.wait(), (e: unknown) => e instanceof BadRequestError && e.message === 'Spawn failed: no such program `nope`');

    host.on(EXEC, async (req, res) => {
      await readAll(req);
      ndjsonHead(res);
      res.write(`{"stdout":"${b64('partial')}"}\n`);
      res.end('{"error":"the sandbox\'s VM stopped: guest kernel panic. Last console lines: Kernel panic","code":"vm_died"}\n');
    });
    const ex2 = await host.client().sandbox('sbx-1').exec('x');
    const seen: string[] = [];
    await assert.rejects(
      (async () => {
        for await (const c of ex2) seen.push(c.data.toString());
      })(),
      (e: unknown) => e instanceof VmDiedError && e.reason === 'guest kernel panic. Last console lines: Kernel panic',
    );
    assert.deepEqual(seen, ['partial']);
    await assert.rejects(ex2.wait(), VmDiedError);

    // A host that hands over to its next run says so; the command runs on in the sandbox.
    host.on(EXEC, async (req, res) => {
      await readAll(req);
      ndjsonHead(res);
      res.end('{"error":"the sandbox host is handing over to its next run (an upgrade): the command keeps running in the sandbox","code":"host_restarting"}\n');
    });
    const ex3 = await host.client().sandbox('sbx-1').exec('x');
    await assert.rejects(ex3.wait(), (e: unknown) => e instanceof HostRestartingError && e.message.startsWith('The sandbox host is handing over'));
  });

  it('a stream that ends without its last line, or breaks off, is StreamCutError', async () => {
    host.on(EXEC, async (req, res) => {
      await readAll(req);
      ndjsonHead(res);
      res.end(`{"stdout":"${b64('x')}"}\n`);
    });
    await assert.rejects((await host.client().sandbox('sbx-1').exec('x')).wait(), StreamCutError);

    host.on(EXEC, async (req, res) => {
      await readAll(req);
      ndjsonHead(res);
      res.write(`{"stdout":"${b64('x')}"}\n{"stdo`);
      await sleep(20);
      res.socket?.destroy();
    });
    await assert.rejects((await host.client().sandbox('sbx-1').exec('x')).wait(), StreamCutError);
  });

  it('backpressure: a slow reader holds the producer back instead of the client buffering', async () => {
    const line = Buffer.from(JSON.stringify({ stdout: Buffer.alloc(48 * 1024, 0x41).toString('base64') }) + '\n');
    const total = 32 * 1024 * 1024;
    let written = 0;
    let finished = false;
    host.on(EXEC, async (req, res) => {
      await readAll(req);
      ndjsonHead(res);
      res.on('close', () => {
        finished = true;
      });
      while (written < total && !res.destroyed) {
        written += line.length;
        if (!res.write(line)) await drainOrClose(res);
      }
      res.end('{"exit_code":0,"signal":null,"timed_out":false,"duration_ms":1}\n');
    });
    const ex = await host.client().sandbox('sbx-1').exec('yes');
    const it = ex[Symbol.asyncIterator]();
    await it.next();
    await it.next();
    // The reader stops; give the producer time to fill every buffer on the way.
    await sleep(400);
    const stalled = written;
    await sleep(200);
    assert.equal(written, stalled, 'the producer is held back while nobody reads');
    process.stderr.write(`# backpressure: ${stalled} bytes of ${total} written while the reader stood still\n`);
    assert.ok(stalled < total / 2, `the producer wrote ${stalled} of ${total} bytes while the reader stood still`);
    const memory = process.memoryUsage().arrayBuffers;
    assert.ok(memory < 64 * 1024 * 1024, `the client holds ${memory} bytes of buffers`);
    // Reading on takes everything, in order, to the exit.
    let bytes = 2 * 48 * 1024;
    for (let r = await it.next(); !r.done; r = await it.next()) bytes += r.value.data.length;
    assert.equal(bytes, Math.ceil(total / line.length) * 48 * 1024);
    assert.equal((await ex.wait()).exit_code, 0);
    assert.ok(finished);
  });

  it('aborting the signal mid-stream throws its reason and closes the connection', async () => {
    let closedEarly: Promise<boolean> = Promise.resolve(false);
    host.on(EXEC, async (req, res) => {
      await readAll(req);
      ndjsonHead(res);
      closedEarly = new Promise((resolve) => res.on('close', () => resolve(!res.writableFinished)));
      for (let i = 0; i < 1000 && !res.destroyed; i++) {
        res.write(`{"stdout":"${b64(`tick ${i}\n`)}"}\n`);
        await sleep(5);
      }
      res.end('{"exit_code":0,"signal":null,"timed_out":false,"duration_ms":1}\n');
    });
    const ac = new AbortController();
    const ex = await host.client().sandbox('sbx-1').exec('ticks', { signal: ac.signal });
    const seen: string[] = [];
    await assert.rejects(
      (async () => {
        for await (const c of ex) {
          seen.push(c.data.toString());
          if (seen.length === 3) ac.abort();
        }
      })(),
      (e: unknown) => e instanceof DOMException && e.name === 'AbortError',
    );
    assert.ok(seen.length >= 3 && seen.length < 10);
    assert.equal(await closedEarly, true, 'the host saw the connection close before the end (it kills the command)');
    await assert.rejects(ex.wait(), (e: unknown) => e instanceof DOMException && e.name === 'AbortError');
  });

  it('leaving the loop early closes the connection (the host kills the command)', async () => {
    let closedEarly: Promise<boolean> = Promise.resolve(false);
    host.on(EXEC, async (req, res) => {
      await readAll(req);
      ndjsonHead(res);
      closedEarly = new Promise((resolve) => res.on('close', () => resolve(!res.writableFinished)));
      for (let i = 0; i < 1000 && !res.destroyed; i++) {
        res.write(`{"stdout":"${b64('x')}"}\n`);
        await sleep(5);
      }
      res.end();
    });
    const ex = await host.client().sandbox('sbx-1').exec('x');
    for await (const c of ex) {
      void c;
      break;
    }
    assert.equal(await closedEarly, true);
    await assert.rejects(ex.wait(), StreamCutError);
  });
});

/**
 * Retries: idempotent calls (GETs, DELETE, keepalive) are sent again, with backoff, while the
 * connection is refused; calls that are not idempotent never are; nothing else is retried.
 */
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { setTimeout as sleep } from 'node:timers/promises';

import { HostUnreachableError, InternalError, SandboxHost } from '../src/index.js';
import { FakeHost, TOKEN, createdBody, freePort, readAll, sendJson } from './fake-host.js';

/** A fake host that starts listening on `port` after `ms`. */
async function startLater(port: number, ms: number, setup: (h: FakeHost) => void): Promise<FakeHost> {
  await sleep(ms);
  const h = new FakeHost();
  setup(h);
  return h.listen(port);
}

function healthy(h: FakeHost): void {
  h.on('GET /v1/health', (_req, res) => sendJson(res, 200, { available: true, reason: null }));
  h.on('GET /v1/sandboxes', (_req, res) => sendJson(res, 200, { sandboxes: [] }));
  h.on('DELETE /v1/sandboxes/sbx-1', (_req, res) => {
    res.writeHead(204);
    res.end();
  });
  h.on('POST /v1/sandboxes/sbx-1/keepalive', (_req, res) => {
    res.writeHead(204);
    res.end();
  });
  h.on('POST /v1/sandboxes', async (req, res) => {
    await readAll(req);
    sendJson(res, 201, createdBody('sbx-1', 'r'));
  });
  h.on('POST /v1/sandboxes/sbx-1/exec', async (req, res) => {
    await readAll(req);
    res.writeHead(200, { 'content-type': 'application/x-ndjson' });
    res.end('{"exit_code":0,"signal":null,"timed_out":false,"duration_ms":1}\n');
  });
}

describe('retries on a refused connection', () => {
  const retry = { attempts: 6, initialDelayMs: 60, maxDelayMs: 200 };

  for (const [name, call] of [
    ['health (GET)', (c: SandboxHost) => c.health()],
    ['list (GET)', (c: SandboxHost) => c.list()],
    ['dispose (DELETE)', (c: SandboxHost) => c.sandbox('sbx-1').dispose()],
    ['keepalive (POST, idempotent)', (c: SandboxHost) => c.sandbox('sbx-1').keepalive()],
  ] as const) {
    it(`${name} is sent again until the host listens`, async () => {
      const port = await freePort();
      const client = new SandboxHost({ url: `http://127.0.0.1:${port}`, token: TOKEN, retry });
      const later = startLater(port, 100, healthy);
      try {
        await call(client);
        const h = await later;
        assert.equal(h.seen.length, 1, 'one request reached the host');
      } finally {
        await (await later).close();
      }
    });
  }

  for (const [name, call] of [
    ['create', (c: SandboxHost) => c.create({ run_id: 'r', time_limit_ms: 1000, review: false })],
    ['exec', (c: SandboxHost) => c.sandbox('sbx-1').exec('true')],
    ['writeFile', (c: SandboxHost) => c.sandbox('sbx-1').writeFile('/workspace/a', 'x')],
  ] as const) {
    it(`${name} (not idempotent) fails at once and is never sent again`, async () => {
      const port = await freePort();
      const client = new SandboxHost({ url: `http://127.0.0.1:${port}`, token: TOKEN, retry });
      const later = startLater(port, 100, healthy);
      const t0 = Date.now();
      await assert.rejects(call(client), HostUnreachableError);
      assert.ok(Date.now() - t0 < 90, 'no wait before failing');
      const h = await later;
      await sleep(150);
      assert.equal(h.seen.length, 0, 'nothing was sent once the host listened');
      await h.close();
    });
  }

  it('gives up after the attempts, with the refusal as the cause', async () => {
    const port = await freePort();
    const client = new SandboxHost({ url: `http://127.0.0.1:${port}`, token: TOKEN, retry: { attempts: 3, initialDelayMs: 10, maxDelayMs: 20 } });
    const t0 = Date.now();
    await assert.rejects(client.health(), (e: unknown) => e instanceof HostUnreachableError && (e.cause as { code?: string }).code === 'ECONNREFUSED');
    const took = Date.now() - t0;
    assert.ok(took >= 20 && took < 1000, `two waits of 10-20 ms, took ${took} ms`);
  });

  it('an answer is never retried, even an error (the host answered)', async () => {
    const h = await new FakeHost().listen();
    h.on('GET /v1/health', (_req, res) => sendJson(res, 500, { error: 'the guest agent failed', code: 'internal' }));
    await assert.rejects(h.client({ retry }).health(), InternalError);
    assert.equal(h.count('GET /v1/health'), 1);
    await h.close();
  });

  it('a reset connection is not retried (only a refusal proves nothing was received)', async () => {
    const h = await new FakeHost().listen();
    h.on('GET /v1/health', (req) => {
      req.socket.destroy();
    });
    await assert.rejects(h.client({ retry }).health(), HostUnreachableError);
    assert.equal(h.count('GET /v1/health'), 1);
    await h.close();
  });

  it('an abort during the backoff ends the call at once with the signal\'s reason', async () => {
    const port = await freePort();
    const client = new SandboxHost({ url: `http://127.0.0.1:${port}`, token: TOKEN, retry: { attempts: 10, initialDelayMs: 5000, maxDelayMs: 5000 } });
    const ac = new AbortController();
    const t0 = Date.now();
    setTimeout(() => ac.abort(new Error('the run was cancelled')), 50);
    await assert.rejects(client.health({ signal: ac.signal }), (e: unknown) => e instanceof Error && e.message === 'the run was cancelled');
    assert.ok(Date.now() - t0 < 1000);
  });
});

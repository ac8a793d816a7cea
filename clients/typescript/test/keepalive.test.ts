/** The keepalive loop: its interval, and every way it stops (dispose, a gone sandbox) or pauses. */
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { setTimeout as sleep } from 'node:timers/promises';

import { InternalError, KEEPALIVE_INTERVAL_MS, NoSandboxError } from '../src/index.js';
import { FakeHost, createdBody, readAll, sendJson } from './fake-host.js';

describe('keepalive loop', () => {
  let host: FakeHost;
  /** What the fake host answers to a keepalive. */
  let answer: 'ok' | 'gone' | 'fail' | 'paused' = 'ok';

  before(async () => {
    host = await new FakeHost().listen();
    host.on('POST /v1/sandboxes', async (req, res) => {
      await readAll(req);
      sendJson(res, 201, createdBody('sbx-k', 'run-k'));
    });
    host.on('POST /v1/sandboxes/sbx-k/keepalive', (_req, res) => {
      if (answer === 'gone') return sendJson(res, 404, { error: 'no sandbox with id `sbx-k`', code: 'no_sandbox' });
      if (answer === 'fail') return sendJson(res, 500, { error: 'the guest agent failed', code: 'internal' });
      if (answer === 'paused') return sendJson(res, 409, { error: 'sandbox `sbx-k` is paused', code: 'paused' });
      res.writeHead(204);
      res.end();
    });
    host.on('DELETE /v1/sandboxes/sbx-k', (_req, res) => {
      res.writeHead(204);
      res.end();
    });
    host.on('POST /v1/sandboxes/sbx-k/pause', (_req, res) => sendJson(res, 200, { id: 'sbx-k', state: 'paused', pause_ms: 5 }));
    host.on('POST /v1/sandboxes/sbx-k/resume', (_req, res) => sendJson(res, 200, { id: 'sbx-k', state: 'ready', resume_ms: 5 }));
  });
  after(async () => host.close());

  const KEEPALIVE = 'POST /v1/sandboxes/sbx-k/keepalive';

  it("runs at the guide's minute by default", () => {
    assert.equal(KEEPALIVE_INTERVAL_MS, 60_000);
  });

  it('sends one keepalive per interval and stops with dispose()', async () => {
    answer = 'ok';
    const before = host.count(KEEPALIVE);
    const sb = await host.client().create({ run_id: 'run-k', time_limit_ms: 60_000, review: false }, { keepalive: { intervalMs: 40 } });
    const loop = sb.keepaliveLoop;
    assert.ok(loop?.running);
    await sleep(230);
    const sent = host.count(KEEPALIVE) - before;
    assert.ok(sent >= 3 && sent <= 6, `${sent} keepalives in 230 ms at 40 ms`);
    assert.equal(await sb.dispose(), true);
    assert.equal(loop.running, false);
    const atDispose = host.count(KEEPALIVE);
    await sleep(120);
    assert.equal(host.count(KEEPALIVE), atDispose, 'no keepalive after dispose');
    assert.throws(() => sb.startKeepalive());
  });

  it('stops by itself when the sandbox is gone, and says so', async () => {
    answer = 'gone';
    const errors: Array<[unknown, boolean]> = [];
    const sb = host.client().sandbox('sbx-k');
    const loop = sb.startKeepalive({ intervalMs: 20, onError: (e, stopped) => errors.push([e, stopped]) });
    await sleep(120);
    assert.equal(loop.running, false);
    assert.equal(errors.length, 1);
    assert.ok(errors[0]![0] instanceof NoSandboxError);
    assert.equal(errors[0]![1], true);
  });

  it('carries on after a failure that does not end the sandbox', async () => {
    answer = 'fail';
    const errors: unknown[] = [];
    const sb = host.client().sandbox('sbx-k');
    const loop = sb.startKeepalive({ intervalMs: 20, onError: (e) => errors.push(e) });
    await sleep(90);
    answer = 'ok';
    await sleep(60);
    assert.ok(loop.running);
    assert.ok(errors.length >= 2 && errors.every((e) => e instanceof InternalError));
    assert.ok(loop.sent >= 1);
    sb.stopKeepalive();
    assert.equal(loop.running, false);
  });

  it('skips while this client has the sandbox paused, and takes a 409 paused (another client paused it) quietly', async () => {
    answer = 'ok';
    const errors: unknown[] = [];
    const sb = host.client().sandbox('sbx-k');
    const loop = sb.startKeepalive({ intervalMs: 20, onError: (e) => errors.push(e) });
    await sb.pause();
    const atPause = host.count(KEEPALIVE);
    await sleep(100);
    assert.equal(host.count(KEEPALIVE), atPause, 'no keepalive while paused');
    await sb.resume();
    await sleep(60);
    assert.ok(host.count(KEEPALIVE) > atPause);
    answer = 'paused';
    await sleep(60);
    assert.deepEqual(errors, []);
    assert.ok(loop.running);
    sb.stopKeepalive();
  });

  it('does not keep the process alive (its timer is unref’d)', async () => {
    answer = 'ok';
    const sb = host.client().sandbox('sbx-k');
    const loop = sb.startKeepalive({ intervalMs: 60_000 });
    // A ref'd 60 s timer would show among the active handles that keep the loop running.
    const timers = (process as unknown as { _getActiveHandles(): unknown[] })._getActiveHandles().filter(
      (h) => (h as { constructor?: { name?: string } }).constructor?.name === 'Timeout' && (h as { hasRef?: () => boolean }).hasRef?.() === true,
    );
    assert.equal(timers.length, 0);
    loop.stop();
  });
});

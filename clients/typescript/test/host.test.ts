/**
 * The host and sandbox calls as docs/api.md writes them (paths, methods, bodies, statuses), and
 * the clean-up of a server that starts again.
 */
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';

import { NotFoundError, type CreateOptions } from '../src/index.js';
import { FakeHost, TOKEN, createdBody, readAll, sendJson, summaryBody } from './fake-host.js';

describe('host and sandbox calls', () => {
  let host: FakeHost;
  before(async () => {
    host = await new FakeHost().listen();
  });
  after(async () => host.close());

  it('create sends the options as the body and returns a sandbox with the answer', async () => {
    const options: CreateOptions = {
      run_id: 'run-42',
      time_limit_ms: 3_600_000,
      review: true,
      memory_mib: 4096,
      vcpus: 2,
      env: { CI: '1' },
      harness_version: '0.73.1',
      egress: {
        allow: ['registry.npmjs.org'],
        secrets: [{ env: 'ANTHROPIC_API_KEY', value: 'sk-ant-0123456789abcdef', hosts: ['api.anthropic.com'] }],
        meter: ['api.anthropic.com'],
      },
    };
    let body: unknown;
    host.on('POST /v1/sandboxes', async (req, res) => {
      assert.equal(req.headers.authorization, `Bearer ${TOKEN}`);
      assert.equal(req.headers['content-type'], 'application/json');
      body = JSON.parse((await readAll(req)).toString());
      sendJson(res, 201, createdBody('sbx-9f1c', 'run-42', new Date('2030-01-01T00:00:00.000Z')));
    });
    const sb = await host.client().create(options);
    assert.deepEqual(body, options);
    assert.equal(sb.id, 'sbx-9f1c');
    assert.equal(sb.runId, 'run-42');
    assert.equal(sb.created?.started_from, 'boot');
    assert.equal(sb.expiresAt?.toISOString(), '2030-01-01T00:00:00.000Z');
  });

  it('health, list, get, metrics', async () => {
    host.on('GET /v1/health', (_req, res) => sendJson(res, 200, { available: true, reason: null, backend: 'kvm', accel: 'kvm', arch: 'x86_64', version: '0.1.0', image: {} }));
    host.on('GET /v1/sandboxes', (_req, res) => sendJson(res, 200, { sandboxes: [summaryBody('sbx-a', 'run-a')] }));
    host.on('GET /v1/sandboxes/sbx-a', (_req, res) =>
      sendJson(res, 200, { ...summaryBody('sbx-a', 'run-a'), egress: { refused: 0, by_reason: {}, events: [] }, usage: { calls: 0 } }),
    );
    host.on('GET /metrics', (_req, res) => {
      res.writeHead(200, { 'content-type': 'text/plain' });
      res.end('sandbox_host_boots_total 3\n');
    });
    const c = host.client();
    assert.equal((await c.health()).backend, 'kvm');
    assert.equal((await c.ready()).available, true);
    assert.deepEqual((await c.list()).map((s) => s.run_id), ['run-a']);
    const sb = await c.get('sbx-a');
    assert.equal(sb.runId, 'run-a');
    assert.equal(sb.details?.egress.refused, 0);
    assert.ok(sb.expiresAt instanceof Date);
    assert.match(await c.metrics(), /sandbox_host_boots_total 3/);
  });

  it('drain: PUT with the flag, the answer, and an unknown host', async () => {
    let body: unknown;
    host.on('PUT /v1/hosts/node-3/drain', async (req, res) => {
      body = JSON.parse((await readAll(req)).toString());
      sendJson(res, 200, { name: 'node-3', draining: true });
    });
    assert.deepEqual(await host.client().drain('node-3', true), { name: 'node-3', draining: true });
    assert.deepEqual(body, { draining: true });
    host.on('PUT /v1/hosts/zz/drain', (_req, res) => sendJson(res, 404, { error: 'no host `zz` in this fleet', code: 'not_found' }));
    await assert.rejects(host.client().drain('zz', false), NotFoundError);
  });

  it('files: write (with its length and mode), read, and a missing one', async () => {
    const files = new Map<string, Buffer>();
    host.on('PUT /v1/sandboxes/sbx-1/files', async (req, res, url) => {
      assert.equal(req.headers['content-type'], 'application/octet-stream');
      assert.equal(url.searchParams.get('mode'), url.searchParams.get('path') === '/workspace/run.sh' ? '755' : null);
      const data = await readAll(req);
      if (req.headers['content-length'] !== undefined) assert.equal(Number(req.headers['content-length']), data.length);
      files.set(url.searchParams.get('path') ?? '', data);
      res.writeHead(204);
      res.end();
    });
    host.on('GET /v1/sandboxes/sbx-1/files', (_req, res, url) => {
      const data = files.get(url.searchParams.get('path') ?? '');
      if (data === undefined) return sendJson(res, 404, { error: `${url.searchParams.get('path')} does not exist`, code: 'not_found' });
      res.writeHead(200, { 'content-type': 'application/octet-stream' });
      res.end(data);
    });
    const sb = host.client().sandbox('sbx-1');
    await sb.writeFile('/workspace/.vantik/prompt.md', 'Fix the bug.\n');
    await sb.writeFile('/workspace/run.sh', Buffer.from('#!/bin/sh\n'), { mode: 0o755 });
    await sb.writeFile('/workspace/empty', '');
    assert.equal((await sb.readFile('/workspace/.vantik/prompt.md')).toString(), 'Fix the bug.\n');
    assert.equal((await sb.readFile('/workspace/empty')).length, 0);
    assert.equal(host.seen.at(-1)?.query.get('path'), '/workspace/empty');
    await assert.rejects(sb.readFile('/workspace/nope'), NotFoundError);
  });

  it('pause, resume, usage, egress, keepalive, dispose: their routes and answers', async () => {
    host.on('POST /v1/sandboxes/sbx-1/pause', (_req, res) => sendJson(res, 200, { id: 'sbx-1', state: 'paused', pause_ms: 412 }));
    host.on('POST /v1/sandboxes/sbx-1/resume', (_req, res) => sendJson(res, 200, { id: 'sbx-1', state: 'ready', resume_ms: 180 }));
    host.on('GET /v1/sandboxes/sbx-1/usage', (_req, res) => sendJson(res, 200, { calls: [], calls_dropped: 0, totals: { calls: 0, input_tokens: 0 } }));
    host.on('GET /v1/sandboxes/sbx-1/egress', (_req, res) => sendJson(res, 200, { refused: 2, by_reason: { name_not_allowed: 2 }, events: [] }));
    host.on('POST /v1/sandboxes/sbx-1/keepalive', (_req, res) => {
      res.writeHead(204);
      res.end();
    });
    host.on('DELETE /v1/sandboxes/sbx-1', (_req, res) => {
      res.writeHead(204);
      res.end();
    });
    const sb = host.client().sandbox('sbx-1');
    assert.equal((await sb.pause()).pause_ms, 412);
    assert.equal((await sb.resume()).state, 'ready');
    assert.equal((await sb.usage()).totals.calls, 0);
    assert.equal((await sb.egress()).by_reason.name_not_allowed, 2);
    await sb.keepalive();
    assert.equal(await sb.dispose(), true);
    host.on('DELETE /v1/sandboxes/sbx-1', (_req, res) => sendJson(res, 404, { error: 'no sandbox with id `sbx-1`', code: 'no_sandbox' }));
    assert.equal(await host.client().sandbox('sbx-1').dispose(), false, 'gone already');
  });

  it('fork: count from the children, each child a handle with its create answer', async () => {
    let asked: unknown;
    host.on('POST /v1/sandboxes/sbx-1/fork', async (req, res) => {
      asked = JSON.parse((await readAll(req)).toString());
      const child = (id: string, run: string) => ({
        id, run_id: run, image: 'vantik-guest:latest', stock_image: false, harness_version_match: null,
        disk_limit_mib: 20480, expires_at: '2026-12-07T13:00:00.000Z', boot_ms: 300, started_from: 'fork', host: null,
      });
      sendJson(res, 201, { id: 'sbx-1', held_ms: 250, fork_ms: 900, children: [child('sbx-2', 'run-a'), child('sbx-3', 'run-b')] });
    });
    const forked = await host.client().sandbox('sbx-1').fork([
      { run_id: 'run-a', time_limit_ms: 60_000 },
      { run_id: 'run-b', time_limit_ms: 60_000, env: { X: '1' } },
    ]);
    assert.deepEqual(asked, { count: 2, children: [{ run_id: 'run-a', time_limit_ms: 60_000 }, { run_id: 'run-b', time_limit_ms: 60_000, env: { X: '1' } }] });
    assert.deepEqual(forked.children.map((c) => [c.id, c.runId, c.created?.started_from]), [['sbx-2', 'run-a', 'fork'], ['sbx-3', 'run-b', 'fork']]);
    assert.equal(forked.heldMs, 250);
    assert.equal(forked.forkMs, 900);
  });

  it('disposeEnded: a restarted server disposes of the sandboxes of ended runs and keeps the live ones', async () => {
    const live = new Map([
      ['sbx-a', 'run-ended-1'],
      ['sbx-b', 'run-live'],
      ['sbx-c', 'run-ended-2'],
      ['sbx-d', 'run-ended-3'],
    ]);
    host.on('GET /v1/sandboxes', (_req, res) => sendJson(res, 200, { sandboxes: [...live].map(([id, run]) => summaryBody(id, run)) }));
    for (const id of live.keys()) {
      host.on(`DELETE /v1/sandboxes/${id}`, (_req, res) => {
        if (id === 'sbx-c') return sendJson(res, 404, { error: `no sandbox with id \`${id}\``, code: 'no_sandbox' });
        if (id === 'sbx-d') return sendJson(res, 500, { error: 'stopping failed', code: 'internal' });
        res.writeHead(204);
        res.end();
      });
    }
    const r = await host.client().disposeEnded(['run-live', 'run-not-on-this-host']);
    assert.deepEqual(r.disposed.map((s) => s.id), ['sbx-a', 'sbx-c']);
    assert.deepEqual(r.kept.map((s) => s.id), ['sbx-b']);
    assert.deepEqual(r.failed.map((f) => f.sandbox.id), ['sbx-d']);
    assert.equal(host.count('DELETE /v1/sandboxes/sbx-b'), 0, 'the live run keeps its sandbox');
  });
});

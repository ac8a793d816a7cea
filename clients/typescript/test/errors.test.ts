/**
 * Every error the API documents maps to its class, and the messages are the operator guide's
 * reasons at the delegate control.
 */
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { after, before, describe, it } from 'node:test';

import {
  BodyTooLargeError,
  ERROR_CLASSES,
  HostRestartingError,
  HostUnavailableError,
  HostUnreachableError,
  NoCapacityError,
  NoSandboxError,
  NotConfiguredError,
  RunTimeLimitError,
  SandboxHost,
  SandboxHostError,
  TokenRefusedError,
  UnavailableError,
  UnexpectedAnswerError,
  VmDiedError,
} from '../src/index.js';
import { FakeHost, TOKEN, createdBody, freePort, readAll, sendJson } from './fake-host.js';

const ROOT = new URL('../../../../', import.meta.url);
const guide = readFileSync(new URL('docs/operator-guide.md', ROOT), 'utf8');
const seedGuide = (() => {
  try {
    return readFileSync('/work/shared/seed/agent-sandbox-operator-guide.txt', 'utf8');
  } catch {
    return undefined;
  }
})();

/** The codes docs/openapi.json's Error schema lists, and those docs/api.md's table lists. */
function documentedCodes(): { openapi: string[]; apiMd: Map<string, number> } {
  const openapi = JSON.parse(readFileSync(new URL('docs/openapi.json', ROOT), 'utf8')) as {
    components: { schemas: { Error: { properties: { code: { enum: string[] } } } } };
  };
  const md = readFileSync(new URL('docs/api.md', ROOT), 'utf8');
  const table = new Map<string, number>();
  for (const m of md.matchAll(/^\| (\d{3}) \| `(\w+)` \|/gm)) table.set(m[2]!, Number(m[1]));
  return { openapi: openapi.components.schemas.Error.properties.code.enum, apiMd: table };
}

describe('errors', () => {
  let host: FakeHost;
  before(async () => {
    host = await new FakeHost().listen();
  });
  after(async () => host.close());

  it('every code of docs/openapi.json and docs/api.md has its own class, reached through a real answer', async () => {
    const { openapi, apiMd } = documentedCodes();
    assert.ok(openapi.length >= 14 && apiMd.size >= 15);
    const codes = new Set([...openapi, ...apiMd.keys()]);
    for (const code of codes) {
      const cls = (ERROR_CLASSES as Record<string, unknown>)[code];
      assert.ok(typeof cls === 'function', `no class for ${code}`);
      const status = apiMd.get(code) ?? 400;
      host.on('GET /v1/sandboxes/sbx-e/usage', (_req, res) => sendJson(res, status, { error: `the host says ${code}`, code }));
      const err = await host
        .client()
        .sandbox('sbx-e')
        .usage()
        .then(
          () => undefined,
          (e: unknown) => e,
        );
      assert.ok(err instanceof (cls as new (...a: never[]) => SandboxHostError), `${code}: ${String(err)}`);
      assert.equal(err.status, status);
      assert.equal(err.code, code);
      assert.equal(err.hostMessage, `the host says ${code}`);
      assert.notEqual(err.constructor, SandboxHostError);
    }
  });

  it('"No sandbox host is configured" without a URL or a token', () => {
    for (const [url, token, missing] of [
      [undefined, TOKEN, ['url']],
      ['http://127.0.0.1:3004', undefined, ['token']],
      ['', '', ['url', 'token']],
      ['not a url', TOKEN, ['url']],
      ['ftp://127.0.0.1', TOKEN, ['url']],
    ] as const) {
      assert.throws(
        () => new SandboxHost({ url, token }),
        (e: unknown) => e instanceof NotConfiguredError && e.message === 'No sandbox host is configured' && e.missing.join() === missing.join(),
      );
    }
    assert.throws(() => SandboxHost.fromEnv({ SANDBOX_HOST_URL: 'http://127.0.0.1:3004' }), NotConfiguredError);
    assert.equal(SandboxHost.fromEnv({ SANDBOX_HOST_URL: 'http://127.0.0.1:3004/', SANDBOX_HOST_TOKEN: TOKEN }).url, 'http://127.0.0.1:3004');
  });

  it('"The sandbox host at <url> did not answer" when nothing listens', async () => {
    const url = `http://127.0.0.1:${await freePort()}`;
    const client = new SandboxHost({ url, token: TOKEN, retry: { attempts: 1 } });
    await assert.rejects(client.health(), (e: unknown) => {
      assert.ok(e instanceof HostUnreachableError);
      assert.equal(e.message, `The sandbox host at ${url} did not answer`);
      assert.equal((e.cause as { code?: string }).code, 'ECONNREFUSED');
      return true;
    });
  });

  it('"The sandbox host refused the server\'s token" on 401', async () => {
    const client = new SandboxHost({ url: host.url, token: 'another-token-0123456789abcdef', retry: { attempts: 1 } });
    await assert.rejects(client.list(), (e: unknown) => e instanceof TokenRefusedError && e.message === "The sandbox host refused the server's token" && e.status === 401);
  });

  it('the guide\'s own words: each message the guide quotes is what the error says', () => {
    const quoted = ['No sandbox host is configured', 'The sandbox host at <url> did not answer', "The sandbox host refused the server's token"];
    for (const q of quoted) {
      // docs/operator-guide.md has the host's side (the last two); the platform's page all three.
      if (q !== quoted[0]) assert.ok(guide.includes(q), `docs/operator-guide.md quotes ${q}`);
      if (seedGuide !== undefined) assert.ok(seedGuide.includes(q), `the seed guide quotes ${q}`);
    }
    assert.equal(new NotConfiguredError(['url']).message, quoted[0]);
    assert.equal(new HostUnreachableError('<url>').message, quoted[1]);
    assert.equal(new TokenRefusedError({ status: 401 }).message, quoted[2]);
  });

  it('413 says the body is larger than N bytes, N from the host\'s answer', async () => {
    const hostText = 'the request body is larger than 1048576 bytes (SANDBOX_HOST_MAX_BODY_MB=1); increase SANDBOX_HOST_MAX_BODY_MB for the sandbox host';
    // The host refuses a streamed body once it is over the limit, before the client has sent it all.
    host.on('PUT /v1/sandboxes/sbx-1/files', async (req, res) => {
      let got = 0;
      for await (const c of req as AsyncIterable<Buffer>) {
        got += c.length;
        if (got > 1024 * 1024) break;
      }
      res.setHeader('connection', 'close');
      sendJson(res, 413, { error: hostText, code: 'body_too_large' });
    });
    async function* big(): AsyncGenerator<Uint8Array> {
      for (let i = 0; i < 64; i++) yield Buffer.alloc(256 * 1024, i);
    }
    await assert.rejects(host.client().sandbox('sbx-1').writeFile('/workspace/big', big()), (e: unknown) => {
      assert.ok(e instanceof BodyTooLargeError, String(e));
      assert.equal(e.limitBytes, 1048576);
      assert.equal(e.limitMb, 1);
      assert.match(e.message, /^The request body is larger than 1048576 bytes/);
      assert.ok(guide.includes('the request body is larger than a number of bytes'));
      return true;
    });
    // Declared up front (bytes with their length): refused before any byte is read.
    host.on('PUT /v1/sandboxes/sbx-1/files', (_req, res) => {
      res.setHeader('connection', 'close');
      sendJson(res, 413, { error: hostText, code: 'body_too_large' });
    });
    await assert.rejects(host.client().sandbox('sbx-1').writeFile('/workspace/big', Buffer.alloc(2 * 1024 * 1024)), BodyTooLargeError);
  });

  it('a host that is restarting says so, for a create and as an exec\'s last line', async () => {
    const text = 'the sandbox host is handing over to its next run (an upgrade): retry in a few seconds';
    host.on('POST /v1/sandboxes', (_req, res) => sendJson(res, 503, { error: text, code: 'host_restarting' }));
    await assert.rejects(host.client().create({ run_id: 'r', time_limit_ms: 1000, review: false }), (e: unknown) => {
      return e instanceof HostRestartingError && e.message === `T${text.slice(1)}`;
    });
  });

  it('a gateway whose host is lost says which host and sandbox', async () => {
    const text = 'The sandbox host b that holds sbx-0123456789abcdef-b did not answer (connection refused); retry later, or make a new sandbox';
    host.on('GET /v1/sandboxes/sbx-0123456789abcdef-b', (_req, res) => sendJson(res, 503, { error: text, code: 'host_unavailable' }));
    await assert.rejects(host.client().sandbox('sbx-0123456789abcdef-b').info(), (e: unknown) => {
      return e instanceof HostUnavailableError && e.message === text;
    });
  });

  it('no capacity and unavailable carry the host\'s reason', async () => {
    const reason = 'guest memory: 4096 MiB asked, 1024 MiB of SANDBOX_HOST_MEMORY_LIMIT_MIB=8192 free';
    host.on('POST /v1/sandboxes', (_req, res) => sendJson(res, 503, { error: reason, code: 'no_capacity' }));
    await assert.rejects(host.client().create({ run_id: 'r', time_limit_ms: 1000, review: false }), (e: unknown) => {
      return e instanceof NoCapacityError && e.reason === reason && e.message === `The sandbox host has no capacity for this sandbox: ${reason}`;
    });
    host.on('POST /v1/sandboxes', (_req, res) =>
      sendJson(res, 503, { error: 'the sandbox host cannot start a microVM: no qemu-img on PATH', code: 'unavailable' }),
    );
    await assert.rejects(host.client().create({ run_id: 'r', time_limit_ms: 1000, review: false }), (e: unknown) => {
      return e instanceof UnavailableError && e.reason === 'no qemu-img on PATH' && e.message === 'The sandbox host cannot start a microVM: no qemu-img on PATH';
    });
    host.on('GET /v1/health', (_req, res) => sendJson(res, 200, { available: false, reason: 'no qemu-img on PATH' }));
    await assert.rejects(host.client().ready(), (e: unknown) => e instanceof UnavailableError && e.reason === 'no qemu-img on PATH');
  });

  it('the VM died, with its reason', async () => {
    host.on('POST /v1/sandboxes/sbx-1/keepalive', (_req, res) =>
      sendJson(res, 410, { error: "the sandbox's VM stopped: out of memory: the VM's process used more than its limit of 4160 MiB", code: 'vm_died' }),
    );
    await assert.rejects(host.client().sandbox('sbx-1').keepalive(), (e: unknown) => {
      return e instanceof VmDiedError && e.reason === "out of memory: the VM's process used more than its limit of 4160 MiB" && e.message.startsWith("The sandbox's VM stopped: out of memory");
    });
  });

  it("the run's time limit: a sandbox past expires_at that is gone is RunTimeLimitError", async () => {
    const expired = new Date(Date.now() - 1000);
    host.on('POST /v1/sandboxes', async (req, res) => {
      await readAll(req);
      sendJson(res, 201, createdBody('sbx-t', 'run-t', expired));
    });
    host.on('POST /v1/sandboxes/sbx-t/exec', async (req, res) => {
      await readAll(req);
      sendJson(res, 404, { error: 'no sandbox with id `sbx-t`', code: 'no_sandbox' });
    });
    host.on('GET /v1/sandboxes/sbx-t/usage', (_req, res) => sendJson(res, 404, { error: 'no sandbox with id `sbx-t`', code: 'no_sandbox' }));
    const sb = await host.client().create({ run_id: 'run-t', time_limit_ms: 1, review: false });
    await assert.rejects(sb.exec('true'), (e: unknown) => e instanceof RunTimeLimitError && e.cause instanceof NoSandboxError && e.expiresAt.getTime() === expired.getTime());
    await assert.rejects(sb.usage(), RunTimeLimitError);
    // Before the limit, the same answer is what it says.
    await assert.rejects(host.client().sandbox('sbx-t', { expiresAt: new Date(Date.now() + 60_000).toISOString() }).usage(), NoSandboxError);
  });

  it('an answer that is not the API\'s JSON is UnexpectedAnswerError (a proxy\'s page), unless its status says enough', async () => {
    host.on('GET /v1/health', (_req, res) => {
      res.writeHead(502, { 'content-type': 'text/html' });
      res.end('<html>Bad gateway</html>');
    });
    await assert.rejects(host.client().health(), (e: unknown) => e instanceof UnexpectedAnswerError && e.status === 502 && /Bad gateway/.test(e.message));
    host.on('GET /v1/health', (_req, res) => {
      res.writeHead(401);
      res.end();
    });
    await assert.rejects(host.client().health(), TokenRefusedError);
    host.on('GET /v1/health', (_req, res) => sendJson(res, 418, { error: 'teapot', code: 'teapot' }));
    await assert.rejects(host.client().health(), (e: unknown) => e instanceof UnexpectedAnswerError && e.code === 'teapot');
  });
});

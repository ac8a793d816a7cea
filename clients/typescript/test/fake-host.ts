/**
 * A fake sandbox host for the unit tests: a real HTTP server on a loopback port whose routes
 * each test writes, so the client's streams, errors and retries go through real sockets. It
 * boots no VM; the flow test (flow.test.ts) runs the real binary.
 */
import http from 'node:http';
import type { AddressInfo } from 'node:net';

import { SandboxHost, type SandboxHostOptions } from '../src/index.js';

export const TOKEN = 'test-token-0123456789abcdef-xyz';

/** A request as the fake host saw it. */
export interface Seen {
  method: string;
  path: string;
  query: URLSearchParams;
  headers: http.IncomingHttpHeaders;
}

export type Handler = (req: http.IncomingMessage, res: http.ServerResponse, url: URL) => void | Promise<void>;

/** A running fake host. */
export class FakeHost {
  readonly server: http.Server;
  readonly seen: Seen[] = [];
  readonly #routes = new Map<string, Handler>();
  port = 0;

  constructor() {
    this.server = http.createServer((req, res) => {
      const url = new URL(req.url ?? '/', 'http://fake');
      this.seen.push({ method: req.method ?? '', path: url.pathname, query: url.searchParams, headers: req.headers });
      if (req.headers.authorization !== `Bearer ${TOKEN}`) {
        sendJson(res, 401, { error: 'missing or wrong bearer token: send Authorization: Bearer <SANDBOX_HOST_TOKEN>', code: 'unauthorized' });
        return;
      }
      const handler = this.#routes.get(`${req.method} ${url.pathname}`);
      if (handler === undefined) {
        sendJson(res, 404, { error: 'no such route; see docs/api.md', code: 'not_found' });
        return;
      }
      Promise.resolve(handler(req, res, url)).catch((err: unknown) => {
        res.destroy(err instanceof Error ? err : new Error(String(err)));
      });
    });
  }

  /** Serves `handler` for `METHOD /path`. */
  on(route: string, handler: Handler): this {
    this.#routes.set(route, handler);
    return this;
  }

  /** Starts listening (on `port`, or a free one). */
  async listen(port = 0): Promise<this> {
    await new Promise<void>((resolve, reject) => {
      this.server.once('error', reject);
      this.server.listen(port, '127.0.0.1', () => resolve());
    });
    this.port = (this.server.address() as AddressInfo).port;
    return this;
  }

  get url(): string {
    return `http://127.0.0.1:${this.port}`;
  }

  /** A client of this host. */
  client(options: Partial<SandboxHostOptions> = {}): SandboxHost {
    return new SandboxHost({ url: this.url, token: TOKEN, retry: { attempts: 1 }, ...options });
  }

  /** The requests seen for `METHOD /path`. */
  count(route: string): number {
    return this.seen.filter((s) => `${s.method} ${s.path}` === route).length;
  }

  async close(): Promise<void> {
    this.server.closeAllConnections();
    await new Promise<void>((resolve) => this.server.close(() => resolve()));
  }
}

export function sendJson(res: http.ServerResponse, status: number, body: unknown): void {
  const text = JSON.stringify(body);
  res.writeHead(status, { 'content-type': 'application/json', 'content-length': Buffer.byteLength(text) });
  res.end(text);
}

/** Reads a request's body whole. */
export async function readAll(req: http.IncomingMessage): Promise<Buffer> {
  const parts: Buffer[] = [];
  for await (const c of req as AsyncIterable<Buffer>) parts.push(c);
  return Buffer.concat(parts);
}

/** A port nothing listens on (bound, then closed). */
export async function freePort(): Promise<number> {
  const s = http.createServer();
  await new Promise<void>((resolve) => s.listen(0, '127.0.0.1', () => resolve()));
  const { port } = s.address() as AddressInfo;
  await new Promise<void>((resolve) => s.close(() => resolve()));
  return port;
}

/** A created sandbox's answer, as the host writes it. */
export function createdBody(id: string, runId: string, expiresAt = new Date(Date.now() + 3_600_000)): Record<string, unknown> {
  return {
    id,
    run_id: runId,
    image: 'stock',
    stock_image: true,
    harness_version_match: null,
    disk_limit_mib: 20480,
    expires_at: expiresAt.toISOString(),
    boot_ms: 12,
    started_from: 'boot',
  };
}

/** A sandbox summary, as `GET /v1/sandboxes` lists it. */
export function summaryBody(id: string, runId: string): Record<string, unknown> {
  const now = new Date().toISOString();
  return {
    id,
    run_id: runId,
    state: 'ready',
    reason: null,
    image: 'stock',
    stock_image: true,
    memory_mib: 256,
    vcpus: 1,
    disk_limit_mib: 20480,
    created_at: now,
    last_activity_at: now,
    expires_at: new Date(Date.now() + 3_600_000).toISOString(),
    boot_ms: 12,
    execs: 0,
    bytes_in: 0,
    bytes_out: 0,
    egress_settings: { allow: [], meter: [], secrets: [], intercept: 'secret_and_meter_hosts', meter_strict: false },
  };
}

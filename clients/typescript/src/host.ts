/**
 * The sandbox host as the server sees it: its health, the sandboxes it creates and lists, and
 * the clean-up of a server that starts again.
 */
import { NoSandboxError, UnavailableError } from './errors.js';
import type { KeepaliveOptions } from './keepalive.js';
import { Sandbox, type CallOptions } from './sandbox.js';
import { Transport, type RetryOptions } from './transport.js';
import type { CreateOptions, Created, Health, SandboxSummary } from './types.js';

/** How to reach the host. */
export interface SandboxHostOptions {
  /** `SANDBOX_HOST_URL`, e.g. `http://127.0.0.1:3004`. Without it: `NotConfiguredError`. */
  url: string | undefined;
  /** `SANDBOX_HOST_TOKEN`, the bearer token the host shares. Without it: `NotConfiguredError`. */
  token: string | undefined;
  /** Retries of idempotent calls on a refused connection (default 4 attempts, 200 ms doubling to 2 s). */
  retry?: Partial<RetryOptions> | undefined;
  /** How long a connection may take to open before the host "did not answer" (default 10 000 ms; 0: no bound). */
  connectTimeoutMs?: number | undefined;
}

/** Options of `create`. */
export interface CreateCallOptions extends CallOptions {
  /** Start the sandbox's keepalive loop at once (`true`, or its options). Default: no loop. */
  keepalive?: boolean | KeepaliveOptions | undefined;
}

/** What `disposeEnded` did. */
export interface DisposeEndedResult {
  /** Sandboxes of ended runs, disposed of (or found gone meanwhile). */
  disposed: SandboxSummary[];
  /** Sandboxes of active runs, kept. */
  kept: SandboxSummary[];
  /** Sandboxes of ended runs whose disposal failed, with why; try again later. */
  failed: Array<{ sandbox: SandboxSummary; error: unknown }>;
}

/** A sandbox host. */
export class SandboxHost {
  readonly #transport: Transport;

  /** Throws `NotConfiguredError` ("No sandbox host is configured") without a URL or a token. */
  constructor(options: SandboxHostOptions) {
    this.#transport = new Transport({
      url: options.url ?? '',
      token: options.token ?? '',
      retry: options.retry,
      connectTimeoutMs: options.connectTimeoutMs,
    });
  }

  /** A host from `SANDBOX_HOST_URL` and `SANDBOX_HOST_TOKEN` (of `env`, default `process.env`). */
  static fromEnv(env: Readonly<Record<string, string | undefined>> = process.env, options: Omit<SandboxHostOptions, 'url' | 'token'> = {}): SandboxHost {
    return new SandboxHost({ ...options, url: env.SANDBOX_HOST_URL, token: env.SANDBOX_HOST_TOKEN });
  }

  /** The host's address as configured. */
  get url(): string {
    return this.#transport.url;
  }

  /** `GET /v1/health`: whether the host can start microVMs, and its budgets. */
  async health(options: CallOptions = {}): Promise<Health> {
    return this.#transport.json<Health>({ method: 'GET', path: '/v1/health', idempotent: true, signal: options.signal });
  }

  /**
   * The check behind the delegate control: resolves with the health when the host answers, takes
   * the token and can start microVMs; otherwise throws the error whose message is the reason to
   * show (`HostUnreachableError`, `TokenRefusedError`, `UnavailableError`, ...).
   */
  async ready(options: CallOptions = {}): Promise<Health> {
    const health = await this.health(options);
    if (!health.available) {
      throw new UnavailableError({ status: 200, code: 'unavailable', message: health.reason ?? 'the host says it cannot start microVMs' });
    }
    return health;
  }

  /**
   * `POST /v1/sandboxes`: starts a microVM for a run and resolves once its agent is ready. Never
   * retried (a second request would start a second VM); `NoCapacityError` when the host is full.
   */
  async create(options: CreateOptions, call: CreateCallOptions = {}): Promise<Sandbox> {
    const created = await this.#transport.json<Created>(
      { method: 'POST', path: '/v1/sandboxes', json: options, idempotent: false, signal: call.signal },
      [201],
    );
    const sandbox = new Sandbox(this.#transport, created.id, { runId: created.run_id, expiresAt: created.expires_at, created });
    if (call.keepalive) sandbox.startKeepalive(call.keepalive === true ? {} : call.keepalive);
    return sandbox;
  }

  /**
   * `PUT /v1/hosts/{name}/drain`: the host named (through a fleet's gateway, any of its hosts;
   * on a host, its own `SANDBOX_HOST_NAME`) takes no new sandboxes while draining, and its
   * sandboxes run to their end. `NotFoundError` for a name it does not know.
   */
  async drain(name: string, draining: boolean, options: CallOptions = {}): Promise<{ name: string; draining: boolean }> {
    return this.#transport.json<{ name: string; draining: boolean }>({
      method: 'PUT',
      path: `/v1/hosts/${encodeURIComponent(name)}/drain`,
      json: { draining },
      idempotent: true,
      signal: options.signal,
    });
  }

  /** `GET /v1/sandboxes`: every sandbox on the host, oldest first. */
  async list(options: CallOptions = {}): Promise<SandboxSummary[]> {
    const r = await this.#transport.json<{ sandboxes: SandboxSummary[] }>({ method: 'GET', path: '/v1/sandboxes', idempotent: true, signal: options.signal });
    return r.sandboxes;
  }

  /** `GET /v1/sandboxes/{id}`: a sandbox and its details; `NoSandboxError` when it does not exist. */
  async get(id: string, options: CallOptions = {}): Promise<Sandbox> {
    const details = await new Sandbox(this.#transport, id).info(options);
    return new Sandbox(this.#transport, id, { runId: details.run_id, expiresAt: details.expires_at, details });
  }

  /** A handle on a sandbox by id, without a request (for an id the server kept). */
  sandbox(id: string, known: { runId?: string; expiresAt?: string } = {}): Sandbox {
    return new Sandbox(this.#transport, id, known);
  }

  /**
   * For a server that starts again: disposes of every sandbox whose run is not among
   * `activeRunIds` (operator guide: "When the server starts again, it disposes of the sandboxes
   * of runs that ended"), and keeps the others. A sandbox that is gone meanwhile counts as
   * disposed of; one whose disposal fails is reported in `failed`, the others still go.
   * Disposals run `concurrency` at once (default 4).
   */
  async disposeEnded(activeRunIds: Iterable<string>, options: CallOptions & { concurrency?: number } = {}): Promise<DisposeEndedResult> {
    const active = new Set(activeRunIds);
    const all = await this.list(options);
    const ended = all.filter((s) => !active.has(s.run_id));
    const outcome = new Map<string, { error: unknown } | null>();
    // A few at once: each disposal waits for its VM to stop (seconds), and a server that was
    // down for long may find many.
    const queue = [...ended];
    const worker = async (): Promise<void> => {
      for (let s = queue.shift(); s !== undefined; s = queue.shift()) {
        try {
          await this.sandbox(s.id).dispose(options);
          outcome.set(s.id, null);
        } catch (error) {
          if (options.signal?.aborted) throw options.signal.reason;
          outcome.set(s.id, error instanceof NoSandboxError ? null : { error });
        }
      }
    };
    await Promise.all(Array.from({ length: Math.max(1, options.concurrency ?? 4) }, worker));
    const result: DisposeEndedResult = { disposed: [], kept: [], failed: [] };
    for (const s of all) {
      const o = outcome.get(s.id);
      if (active.has(s.run_id)) result.kept.push(s);
      else if (o === null) result.disposed.push(s);
      else if (o !== undefined) result.failed.push({ sandbox: s, error: o.error });
    }
    return result;
  }

  /** `GET /metrics`: the host's Prometheus text. */
  async metrics(options: CallOptions = {}): Promise<string> {
    const answer = await this.#transport.call({ method: 'GET', path: '/metrics', idempotent: true, signal: options.signal }, [200]);
    const chunks: Buffer[] = [];
    for await (const c of answer.body as AsyncIterable<Buffer>) chunks.push(c);
    return Buffer.concat(chunks).toString('utf8');
  }
}

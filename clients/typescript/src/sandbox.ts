/**
 * One sandbox of a run: commands, files and archives in its guest, its keepalive loop, pause and
 * resume, its egress and usage read-outs, and its disposal. A `Sandbox` is a handle (an id and a
 * transport); it holds no connection between calls.
 */
import type { Readable } from 'node:stream';
import { pipeline } from 'node:stream/promises';

import {
  extractInto,
  packDirectory,
  toReadable,
  toWritable,
  type ByteSink,
  type ByteSource,
  type ExtractOptions,
  type PackOptions,
} from './archive.js';
import {
  NoSandboxError,
  PausedError,
  RunTimeLimitError,
  StreamCutError,
  VmDiedError,
} from './errors.js';
import { Execution } from './exec.js';
import { KeepaliveLoop, type KeepaliveOptions } from './keepalive.js';
import { Terminal } from './terminal.js';
import { readBody, rethrowIfAborted, type Answer, type Transport } from './transport.js';
import type { Created, Egress, ForkChild, Forked, Paused, PortLink, Resumed, SandboxDetail, Usage, WatchEvent } from './types.js';
import { lines } from './ndjson.js';

/** Options every call takes. */
export interface CallOptions {
  /** Aborts the call (and, for a stream, the transfer); it then throws the signal's reason. */
  signal?: AbortSignal | undefined;
}

/** Options of `exec`. */
export interface ExecOptions extends CallOptions {
  /** Bytes for the command's stdin (then stdin is closed). Without it stdin is `/dev/null`. */
  stdin?: string | Uint8Array | undefined;
  /** Variables for this command, over the sandbox's own `env`. */
  env?: Record<string, string> | undefined;
  /** The working directory, absolute (default `/workspace`). */
  cwd?: string | undefined;
  /** Kill the command's process group after this long; its exit then has `timed_out: true`. */
  timeoutMs?: number | undefined;
}

/** Options of `putArchive`. */
export interface PutArchiveOptions extends CallOptions, PackOptions {
  /** The body's type for a stream (the host recognises gzip by its magic bytes anyway). */
  contentType?: 'application/x-tar' | 'application/gzip' | undefined;
}

/** Options of `getArchive`. */
export interface GetArchiveOptions extends CallOptions, ExtractOptions {}

/** Options of `writeFile`. */
export interface WriteFileOptions extends CallOptions {
  /** Permission bits: a number (`0o755`) or octal digits (`"755"`); default 644. */
  mode?: number | string | undefined;
}

/** Options of `Sandbox.watch`. */
export interface WatchOptions extends CallOptions {
  /** Its subdirectories too, and each one made later (default false). */
  recursive?: boolean;
  /** End the watch after this long (its last event is `end`). */
  timeoutMs?: number;
}

/** Options of `Sandbox.terminal`. */
export interface TerminalOptions extends CallOptions {
  /** A shell string; a login shell (bash if the image has it, else sh) when absent. */
  command?: string;
  /** Working directory, absolute; `/workspace` when absent. */
  cwd?: string;
  /** Lines at the start (default 24). */
  rows?: number;
  /** Columns at the start (default 80). */
  cols?: number;
}

/** A sandbox on the host. */

export class Sandbox {
  /** Its id (`sbx-…`). */
  readonly id: string;
  /** The run it belongs to, when known (from create, get or list). */
  readonly runId: string | undefined;
  /** The create's answer, for a sandbox this client created. */
  readonly created: Created | undefined;
  readonly #transport: Transport;
  #expiresAt: Date | undefined;
  #details: SandboxDetail | undefined;
  #keepalive: KeepaliveLoop | undefined;
  #paused = false;
  #disposed = false;

  /** @internal Made by `SandboxHost`. */
  constructor(transport: Transport, id: string, known: { runId?: string | undefined; expiresAt?: string | undefined; created?: Created | undefined; details?: SandboxDetail | undefined } = {}) {
    this.#transport = transport;
    this.id = id;
    this.runId = known.runId;
    this.created = known.created;
    this.#expiresAt = known.expiresAt !== undefined ? new Date(known.expiresAt) : undefined;
    this.#details = known.details;
  }

  /** The details of the last `info()` (or of `SandboxHost.get`), if any. */
  get details(): SandboxDetail | undefined {
    return this.#details;
  }

  /** The end of the run's time limit, when known. */
  get expiresAt(): Date | undefined {
    return this.#expiresAt;
  }

  /** Whether this client disposed of the sandbox. */
  get disposed(): boolean {
    return this.#disposed;
  }

  #path(tail = ''): string {
    return `/v1/sandboxes/${encodeURIComponent(this.id)}${tail}`;
  }

  /**
   * The error to throw for a failure: past the run's time limit, the sandbox's disappearance
   * (`no_sandbox`, `vm_died`, a stream cut) is the run's time limit.
   */
  explain(err: unknown): unknown {
    const gone = err instanceof NoSandboxError || err instanceof VmDiedError || err instanceof StreamCutError;
    if (gone && this.#expiresAt !== undefined && Date.now() >= this.#expiresAt.getTime()) {
      return new RunTimeLimitError(this.#expiresAt, { cause: err });
    }
    return err;
  }

  async #guard<T>(run: () => Promise<T>): Promise<T> {
    try {
      return await run();
    } catch (err) {
      throw this.explain(err);
    }
  }

  /** `GET /v1/sandboxes/{id}`: its state, counters, egress and usage totals. */
  async info(options: CallOptions = {}): Promise<SandboxDetail> {
    const detail = await this.#guard(() =>
      this.#transport.json<SandboxDetail>({ method: 'GET', path: this.#path(), idempotent: true, signal: options.signal }),
    );
    this.#expiresAt = new Date(detail.expires_at);
    this.#details = detail;
    return detail;
  }

  /**
   * `POST /v1/sandboxes/{id}/exec`: starts a command and resolves once the host has started it,
   * with its output to read as it happens. `command` is a shell string (`/bin/sh -c`) or an argv.
   * An error before the start (unknown sandbox, paused, VM died) rejects this promise; an error
   * after it (no such program, the VM died midway) is thrown by the iteration and `wait()`.
   * Never retried: a command may have run.
   */
  async exec(command: string | readonly string[], options: ExecOptions = {}): Promise<Execution> {
    const body: Record<string, unknown> = typeof command === 'string' ? { command } : { argv: [...command] };
    if (options.cwd !== undefined) body.cwd = options.cwd;
    if (options.env !== undefined) body.env = options.env;
    if (options.timeoutMs !== undefined) body.timeout_ms = options.timeoutMs;
    if (options.stdin !== undefined) {
      body.stdin = (typeof options.stdin === 'string' ? Buffer.from(options.stdin, 'utf8') : Buffer.from(options.stdin)).toString('base64');
    }
    const answer = await this.#guard(() =>
      this.#transport.call({ method: 'POST', path: this.#path('/exec'), json: body, idempotent: false, signal: options.signal }, [200]),
    );
    return new Execution(answer.body, { signal: options.signal, explain: (e) => this.explain(e) });
  }

  /**
   * `PUT /v1/sandboxes/{id}/archive`: a directory of this machine (packed as it is sent, `.git`
   * included), or a tar or tar.gz stream, extracted into `path` of the guest (default
   * `/workspace`, created if missing). Streamed: the host extracts as the bytes arrive.
   */
  async putArchive(source: string | ByteSource, path = '/workspace', options: PutArchiveOptions = {}): Promise<void> {
    let body: Readable | Uint8Array;
    let contentType = options.contentType ?? 'application/x-tar';
    if (typeof source === 'string') {
      body = await packDirectory(source, options);
      contentType = options.gzip ? 'application/gzip' : 'application/x-tar';
    } else {
      body = toReadable(source);
    }
    await this.#guard(() =>
      this.#transport.empty({ method: 'PUT', path: this.#path('/archive'), query: { path }, body, contentType, idempotent: false, signal: options.signal }),
    );
  }

  /**
   * `GET /v1/sandboxes/{id}/archive`: the guest's directory `path` as a tar stream, extracted
   * into a directory of this machine (created if missing), or written to a stream. A stream the
   * host cut midway throws `StreamCutError` (what was extracted so far stays).
   */
  async getArchive(path: string, target: string | ByteSink, options: GetArchiveOptions = {}): Promise<void> {
    const answer = await this.#guard(() =>
      this.#transport.call({ method: 'GET', path: this.#path('/archive'), query: { path }, idempotent: true, signal: options.signal }, [200]),
    );
    await this.#receive(answer, options.signal, 'the archive stream', async (body) => {
      if (typeof target === 'string') await extractInto(body, target, options);
      else await pipeline(body, toWritable(target));
    });
  }

  /** `GET /v1/sandboxes/{id}/archive` as a tar stream to read yourself (a Node Readable). */
  async archiveStream(path = '/workspace', options: CallOptions = {}): Promise<Readable> {
    const answer = await this.#guard(() =>
      this.#transport.call({ method: 'GET', path: this.#path('/archive'), query: { path }, idempotent: true, signal: options.signal }, [200]),
    );
    return answer.body;
  }

  /** `GET /v1/sandboxes/{id}/files`: a file of the guest, whole. `NotFoundError` when it does not exist. */
  async readFile(path: string, options: CallOptions & { maxBytes?: number } = {}): Promise<Buffer> {
    const answer = await this.#guard(() =>
      this.#transport.call({ method: 'GET', path: this.#path('/files'), query: { path }, idempotent: true, signal: options.signal }, [200]),
    );
    let data: Buffer = Buffer.alloc(0);
    await this.#receive(answer, options.signal, 'the file', async (body) => {
      data = await readBody(body, options.maxBytes ?? Number.MAX_SAFE_INTEGER, false);
    });
    return data;
  }

  /**
   * `GET /v1/sandboxes/{id}/watch`: the file events of the guest's directory `path` (default
   * `/workspace`) as they happen, the first one `ready` once the watch is set. Read with
   * `for await`; leaving the loop (or aborting `signal`) ends the watch in the guest. An
   * `overflow` event says events were lost (the reader fell behind): read the tree again.
   */
  async watch(path = '/workspace', options: WatchOptions = {}): Promise<AsyncGenerator<WatchEvent, void, undefined>> {
    const query: Record<string, string> = { path, recursive: String(options.recursive ?? false) };
    if (options.timeoutMs !== undefined) query.timeout_ms = String(options.timeoutMs);
    const answer = await this.#guard(() =>
      this.#transport.call({ method: 'GET', path: this.#path('/watch'), query, idempotent: true, signal: options.signal }, [200]),
    );
    const body = answer.body;
    const explain = (e: unknown) => this.explain(e);
    return (async function* events(): AsyncGenerator<WatchEvent, void, undefined> {
      try {
        for await (const line of lines(body)) {
          if (line.length > 0) yield JSON.parse(line.toString('utf8')) as WatchEvent;
        }
      } catch (err) {
        rethrowIfAborted(options.signal, err);
        throw explain(err);
      } finally {
        body.destroy();
      }
    })();
  }

  /**
   * `GET /v1/sandboxes/{id}/pty`: a terminal in the guest (a real pseudo terminal: job control,
   * Ctrl-C as `\x03`, `resize`), for a person's browser terminal or an interactive tool. Resolves
   * once the WebSocket is open; a request the host refuses throws its error, as other calls do.
   */
  async terminal(options: TerminalOptions = {}): Promise<Terminal> {
    const query: Record<string, string | undefined> = {
      command: options.command,
      cwd: options.cwd,
      rows: options.rows === undefined ? undefined : String(options.rows),
      cols: options.cols === undefined ? undefined : String(options.cols),
    };
    const ws = await this.#guard(() =>
      this.#transport.websocket(this.#path('/pty'), query, 'v4.channel.k8s.io', 16 << 20, options.signal),
    );
    return new Terminal(ws);
  }

  /**
   * `POST /v1/sandboxes/{id}/ports/{port}/url`: a signed link a person's browser opens without
   * the token, to the server the run started on `port` in the guest (any path under it, its
   * WebSockets included), until `expires_at` (`ttlS`, default an hour, at most 7 days) or the
   * sandbox's end. `url` is for the address this client reached.
   */
  async portUrl(port: number, options: CallOptions & { ttlS?: number } = {}): Promise<PortLink> {
    const json = options.ttlS === undefined ? {} : { ttl_s: options.ttlS };
    return this.#guard(() =>
      this.#transport.json<PortLink>({ method: 'POST', path: this.#path(`/ports/${port}/url`), json, idempotent: false, signal: options.signal }),
    );
  }

  /**
   * `PUT /v1/sandboxes/{id}/files`: writes a file of the guest (atomically: a reader never sees
   * half of it; parent directories created). Bytes and strings are sent with their length, so a
   * body over the host's limit is refused before it is sent.
   */
  async writeFile(path: string, data: ByteSource, options: WriteFileOptions = {}): Promise<void> {
    const query: Record<string, string> = { path };
    if (options.mode !== undefined) query.mode = typeof options.mode === 'number' ? options.mode.toString(8) : options.mode;
    await this.#guard(() =>
      this.#transport.empty({
        method: 'PUT',
        path: this.#path('/files'),
        query,
        body: toReadable(data),
        contentType: 'application/octet-stream',
        idempotent: false,
        signal: options.signal,
      }),
    );
  }

  /** `POST /v1/sandboxes/{id}/keepalive`: counts as activity, nothing else. Retried on a refused connection. */
  async keepalive(options: CallOptions = {}): Promise<void> {
    await this.#guard(() => this.#transport.empty({ method: 'POST', path: this.#path('/keepalive'), idempotent: true, signal: options.signal }));
  }

  /**
   * Starts the keepalive loop (one keepalive a minute by default) unless it runs already, and
   * returns it. It stops on `dispose()`, on `stopKeepalive()`, and when a keepalive finds the
   * sandbox gone; it skips the keepalives while this client has the sandbox paused.
   */
  startKeepalive(options: KeepaliveOptions = {}): KeepaliveLoop {
    if (this.#keepalive?.running) return this.#keepalive;
    if (this.#disposed) throw new Error(`sandbox ${this.id} was disposed of`);
    this.#keepalive = new KeepaliveLoop(
      {
        keepalive: async (signal) => {
          try {
            await this.keepalive({ signal });
          } catch (err) {
            // Paused by another client: a paused sandbox has no idle timer to hold off.
            if (err instanceof PausedError) return;
            throw err;
          }
        },
        isPaused: () => this.#paused,
        isTerminal: (err) => err instanceof NoSandboxError || err instanceof VmDiedError || err instanceof RunTimeLimitError,
      },
      options,
    );
    return this.#keepalive;
  }

  /** Stops the keepalive loop, if one runs. */
  stopKeepalive(): void {
    this.#keepalive?.stop();
  }

  /** The keepalive loop, if one was started. */
  get keepaliveLoop(): KeepaliveLoop | undefined {
    return this.#keepalive;
  }

  /**
   * `POST /v1/sandboxes/{id}/pause` (KVM backend; `ConflictError` on QEMU or while a request
   * runs in it). The keepalive loop skips while it is paused. Retried on a refused connection:
   * pausing a paused sandbox answers 200 again.
   */
  async pause(options: CallOptions = {}): Promise<Paused> {
    const r = await this.#guard(() =>
      this.#transport.json<Paused>({ method: 'POST', path: this.#path('/pause'), idempotent: true, signal: options.signal }),
    );
    this.#paused = true;
    return r;
  }

  /**
   * `POST /v1/sandboxes/{id}/fork`: one new sandbox per entry of `children`, each with this one's
   * memory, processes, files and disk and a run of its own (its run id, time limit, env and
   * egress: new placeholders, a new CA, counters from zero). This sandbox is held only while it
   * is copied, then runs on. All children start or none. Never retried (a second request would
   * fork again). Resolves with the children's handles, in order, and the fork's timings.
   */
  async fork(children: ForkChild[], options: CallOptions = {}): Promise<{ children: Sandbox[]; heldMs: number; forkMs: number }> {
    const r = await this.#guard(() =>
      this.#transport.json<Forked>(
        { method: 'POST', path: this.#path('/fork'), json: { count: children.length, children }, idempotent: false, signal: options.signal },
        [201],
      ),
    );
    return {
      children: r.children.map((c) => new Sandbox(this.#transport, c.id, { runId: c.run_id, expiresAt: c.expires_at, created: c })),
      heldMs: r.held_ms,
      forkMs: r.fork_ms,
    };
  }

  /** `POST /v1/sandboxes/{id}/resume`. Retried on a refused connection: resuming a running sandbox answers 200. */
  async resume(options: CallOptions = {}): Promise<Resumed> {
    const r = await this.#guard(() =>
      this.#transport.json<Resumed>({ method: 'POST', path: this.#path('/resume'), idempotent: true, signal: options.signal }),
    );
    this.#paused = false;
    return r;
  }

  /** `GET /v1/sandboxes/{id}/usage`: the metered model calls and their totals. */
  async usage(options: CallOptions = {}): Promise<Usage> {
    return this.#guard(() => this.#transport.json<Usage>({ method: 'GET', path: this.#path('/usage'), idempotent: true, signal: options.signal }));
  }

  /** `GET /v1/sandboxes/{id}/egress`: what the egress stack refused and carried. */
  async egress(options: CallOptions = {}): Promise<Egress> {
    return this.#guard(() => this.#transport.json<Egress>({ method: 'GET', path: this.#path('/egress'), idempotent: true, signal: options.signal }));
  }

  /**
   * `DELETE /v1/sandboxes/{id}`: stops the keepalive loop, then the VM, and removes every file
   * of it. Resolves `true` when this call removed it, `false` when it was gone already.
   */
  async dispose(options: CallOptions = {}): Promise<boolean> {
    this.stopKeepalive();
    try {
      await this.#transport.empty({ method: 'DELETE', path: this.#path(), idempotent: true, signal: options.signal });
      this.#disposed = true;
      return true;
    } catch (err) {
      if (err instanceof NoSandboxError) {
        this.#disposed = true;
        return false;
      }
      throw err;
    }
  }

  /** Reads an answer's body with `read`, a broken stream as `StreamCutError`, an abort as the signal's reason. */
  async #receive(answer: Answer, signal: AbortSignal | undefined, what: string, read: (body: Readable) => Promise<void>): Promise<void> {
    try {
      await read(answer.body);
    } catch (err) {
      answer.abort();
      rethrowIfAborted(signal, err);
      if (isStreamFailure(err)) throw this.explain(new StreamCutError(`${what} broke off before its end`, { cause: err }));
      throw err;
    }
  }
}

/** Whether an error is the connection's (a reset, an abort by the host), not the consumer's. */
function isStreamFailure(err: unknown): boolean {
  const code = (err as { code?: unknown } | null)?.code;
  return (
    code === 'ECONNRESET' ||
    code === 'ERR_STREAM_PREMATURE_CLOSE' ||
    code === 'EPIPE' ||
    (err instanceof Error && err.message === 'aborted')
  );
}

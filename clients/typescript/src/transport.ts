/**
 * HTTP to the sandbox host on Node's own `node:http` (no HTTP library): the bearer token on
 * every request, abort by `AbortSignal`, a bound on how long a connection takes to open,
 * retries of idempotent requests on a refused connection, and answers as Node streams so that a
 * caller reads a response body at its own pace (the socket stops being read when it stops).
 *
 * Why not the global `fetch`: Node's `fetch` (undici) ends a response whose body is silent for
 * 300 s (`bodyTimeout`) and one whose headers take 300 s (`headersTimeout`), and only the
 * `undici` package's `Agent` can change that. An exec of a command that prints nothing for five
 * minutes (a quiet test suite, `sleep`) would fail with it; `node:http` has no such timeout.
 */
import http from 'node:http';
import https from 'node:https';
import type { Readable } from 'node:stream';
import { setTimeout as delay } from 'node:timers/promises';

import WebSocket from 'ws';

import { HostUnreachableError, NotConfiguredError, StreamCutError, errorFromAnswer, type HostAnswer } from './errors.js';

/** How idempotent requests are retried when the connection is refused. */
export interface RetryOptions {
  /** Attempts in all, the first included (default 4). 1 turns retries off. */
  attempts: number;
  /** The wait before the second attempt; each next wait doubles (default 200 ms). */
  initialDelayMs: number;
  /** The longest wait between two attempts (default 2000 ms). */
  maxDelayMs: number;
}

/** The defaults: four attempts over about 1.4 s, long enough for a host that is restarting. */
export const DEFAULT_RETRY: Readonly<RetryOptions> = { attempts: 4, initialDelayMs: 200, maxDelayMs: 2000 };

/** What a transport needs. */
export interface TransportOptions {
  url: string;
  token: string;
  retry?: Partial<RetryOptions> | undefined;
  connectTimeoutMs?: number | undefined;
}

/** One request. */
export interface Call {
  method: 'GET' | 'POST' | 'PUT' | 'DELETE';
  /** The path from the base URL on, `/v1/...`. */
  path: string;
  query?: Record<string, string | undefined> | undefined;
  /** A JSON body. */
  json?: unknown;
  /** A raw body: bytes (sent with their length) or a stream (sent chunked, read as it is sent). */
  body?: Uint8Array | Readable | undefined;
  contentType?: string | undefined;
  /** Whether the request may be sent again after a refused connection. */
  idempotent: boolean;
  signal?: AbortSignal | undefined;
}

/** The host's answer: status, headers, and its body as a stream not yet read. */
export interface Answer {
  status: number;
  headers: http.IncomingHttpHeaders;
  body: http.IncomingMessage;
  /** Ends the exchange at once (the connection is closed; an upload still running stops). */
  abort(): void;
}

/** A failure of the request body's own source (a directory that cannot be read, say). */
class SourceError extends Error {
  constructor(readonly source: unknown) {
    super('the request body failed');
  }
}

/** Whether a connection failure is a refusal: nothing listens there, so nothing was received. */
export function isRefused(err: unknown): boolean {
  if (typeof err !== 'object' || err === null) return false;
  if ((err as { code?: unknown }).code === 'ECONNREFUSED') return true;
  // Node 20 tries each address of a name (localhost: ::1 and 127.0.0.1) and reports them all.
  if (err instanceof AggregateError) return err.errors.length > 0 && err.errors.every(isRefused);
  return false;
}

/** The signal's reason as the error to throw (an `AbortError` `DOMException` unless given one). */
function abortReason(signal: AbortSignal): unknown {
  return signal.reason ?? new DOMException('This operation was aborted', 'AbortError');
}

/** Rethrows an abort as the signal's own reason, as `fetch` does. */
export function rethrowIfAborted(signal: AbortSignal | undefined, err: unknown): void {
  if (signal?.aborted) throw abortReason(signal);
  void err;
}

/** The base URL and token, checked: a missing one is the guide's "No sandbox host is configured". */
export function checkConfig(url: string | undefined, token: string | undefined): URL {
  const missing: Array<'url' | 'token'> = [];
  let parsed: URL | undefined;
  try {
    parsed = url ? new URL(url) : undefined;
  } catch {
    parsed = undefined;
  }
  if (parsed === undefined || (parsed.protocol !== 'http:' && parsed.protocol !== 'https:')) missing.push('url');
  if (!token) missing.push('token');
  if (missing.length > 0 || parsed === undefined) throw new NotConfiguredError(missing);
  return parsed;
}

/** Requests to one sandbox host. */
export class Transport {
  /** The base URL as configured (without a trailing slash), as errors show it. */
  readonly url: string;
  readonly #base: URL;
  readonly #token: string;
  readonly #retry: RetryOptions;
  readonly #connectTimeoutMs: number;
  // No keep-alive: every request opens its own connection (well under a millisecond on the
  // loopback), so a request is never sent on a connection the host has just closed, and a
  // refused or reset connection always means the request was not received.
  readonly #agent: http.Agent;

  constructor(options: TransportOptions) {
    this.#base = checkConfig(options.url, options.token);
    this.url = options.url.replace(/\/+$/, '');
    this.#token = options.token;
    this.#retry = { ...DEFAULT_RETRY, ...options.retry };
    this.#connectTimeoutMs = options.connectTimeoutMs ?? 10_000;
    this.#agent = this.#base.protocol === 'https:' ? new https.Agent({ keepAlive: false }) : new http.Agent({ keepAlive: false });
  }

  /** Sends a request, retrying an idempotent one whose connection was refused, and returns the answer. */
  async request(call: Call): Promise<Answer> {
    const { attempts, initialDelayMs, maxDelayMs } = this.#retry;
    for (let attempt = 1; ; attempt++) {
      if (call.signal?.aborted) throw abortReason(call.signal);
      try {
        return await this.#send(call);
      } catch (err) {
        if (call.signal?.aborted) throw abortReason(call.signal);
        if (err instanceof SourceError) throw err.source;
        if (call.idempotent && isRefused(err) && attempt < Math.max(1, attempts)) {
          const wait = Math.min(maxDelayMs, initialDelayMs * 2 ** (attempt - 1));
          try {
            await delay(wait * (0.8 + 0.4 * Math.random()), undefined, { signal: call.signal });
          } catch (e) {
            rethrowIfAborted(call.signal, e);
            throw e;
          }
          continue;
        }
        throw new HostUnreachableError(this.url, { cause: err });
      }
    }
  }

  /**
   * Sends a request and checks its status: one of `expected` returns the answer, anything else
   * throws the error the host's answer means (its body read, at most 64 KiB).
   */
  async call(call: Call, expected: readonly number[]): Promise<Answer> {
    const answer = await this.request(call);
    if (expected.includes(answer.status)) return answer;
    throw await this.failure(answer, call.signal);
  }

  /** The error an unexpected answer means, its body read and the exchange ended. */
  async failure(answer: Answer, signal?: AbortSignal): Promise<Error> {
    let text = '';
    try {
      text = (await readBody(answer.body, 64 * 1024, true)).toString('utf8');
    } catch (err) {
      rethrowIfAborted(signal, err);
    } finally {
      answer.abort();
    }
    const info: HostAnswer = { status: answer.status };
    try {
      const parsed: unknown = JSON.parse(text);
      if (typeof parsed === 'object' && parsed !== null) {
        const { error, code } = parsed as { error?: unknown; code?: unknown };
        if (typeof code === 'string') info.code = code;
        if (typeof error === 'string') info.message = error;
      }
    } catch {
      if (text.trim() !== '') info.message = text.trim().slice(0, 500);
    }
    return errorFromAnswer(info);
  }

  /** Sends a request with a JSON answer and returns it parsed. */
  async json<T>(call: Call, expected: readonly number[] = [200]): Promise<T> {
    const answer = await this.call(call, expected);
    try {
      const buf = await readBody(answer.body, 256 * 1024 * 1024, false);
      return JSON.parse(buf.toString('utf8')) as T;
    } catch (err) {
      rethrowIfAborted(call.signal, err);
      throw new StreamCutError(`the JSON answer to ${call.method} ${call.path} did not arrive whole`, { cause: err });
    }
  }

  /** Sends a request whose answer has no body (`204`). */
  async empty(call: Call, expected: readonly number[] = [204]): Promise<void> {
    const answer = await this.call(call, expected);
    answer.body.resume();
  }

  /**
   * Opens a WebSocket to `path` (a terminal), with the token, offering `protocol`; resolves once
   * the host has switched. A host that refuses (400, 404, 409) throws the error its answer means,
   * as `call` does; a host that does not answer throws `HostUnreachableError`.
   */
  websocket(path: string, query: Record<string, string | undefined>, protocol: string, maxPayload: number, signal?: AbortSignal): Promise<WebSocket> {
    const target = new URL(this.#base.href.replace(/\/+$/, '') + path);
    for (const [k, v] of Object.entries(query)) if (v !== undefined) target.searchParams.set(k, v);
    target.protocol = target.protocol === 'https:' ? 'wss:' : 'ws:';
    return new Promise<WebSocket>((resolve, reject) => {
      if (signal?.aborted) return reject(abortReason(signal));
      const ws = new WebSocket(target, [protocol], {
        headers: { authorization: `Bearer ${this.#token}` },
        handshakeTimeout: this.#connectTimeoutMs,
        maxPayload,
        perMessageDeflate: false,
      });
      const onAbort = () => {
        ws.terminate();
        reject(abortReason(signal as AbortSignal));
      };
      signal?.addEventListener('abort', onAbort, { once: true });
      ws.once('open', () => {
        signal?.removeEventListener('abort', onAbort);
        resolve(ws);
      });
      ws.once('unexpected-response', (_req, res) => {
        signal?.removeEventListener('abort', onAbort);
        const answer: Answer = { status: res.statusCode ?? 0, headers: res.headers, body: res, abort: () => res.destroy() };
        this.failure(answer, signal).then(reject, reject);
      });
      ws.once('error', (err) => {
        signal?.removeEventListener('abort', onAbort);
        reject(new HostUnreachableError(this.url, { cause: err }));
      });
    });
  }

  /** One attempt: resolves with the answer once its headers arrived. */
  #send(call: Call): Promise<Answer> {
    const target = new URL(this.#base.href.replace(/\/+$/, '') + call.path);
    for (const [k, v] of Object.entries(call.query ?? {})) if (v !== undefined) target.searchParams.set(k, v);
    const headers: http.OutgoingHttpHeaders = { authorization: `Bearer ${this.#token}`, accept: 'application/json' };
    let bytes: Uint8Array | undefined;
    if (call.json !== undefined) {
      bytes = Buffer.from(JSON.stringify(call.json), 'utf8');
      headers['content-type'] = 'application/json';
    } else if (call.body instanceof Uint8Array) {
      bytes = call.body;
    }
    if (call.contentType !== undefined) headers['content-type'] = call.contentType;
    if (bytes !== undefined) headers['content-length'] = bytes.byteLength;
    const stream = call.body !== undefined && !(call.body instanceof Uint8Array) ? call.body : undefined;
    // A raw body (a file, an archive) waits for the host's `100 Continue`: a host that refuses
    // the request at once (413 for a declared length over its limit, 404, 409) answers before a
    // byte of it is sent. Sent anyway, it would close the connection under the upload and the
    // client would get a broken pipe instead of the host's answer.
    const expectContinue = call.body !== undefined;
    if (expectContinue) headers.expect = '100-continue';
    const lib = target.protocol === 'https:' ? https : http;

    return new Promise<Answer>((resolve, reject) => {
      let answered = false;
      let bodyStarted = false;
      let continueTimer: NodeJS.Timeout | undefined;
      const options: http.RequestOptions = { method: call.method, headers, agent: this.#agent };
      if (call.signal !== undefined) options.signal = call.signal;
      const req = lib.request(target, options, (res) => {
        answered = true;
        clearTimeout(continueTimer);
        // An answer before the body was all sent is a refusal: stop sending, read the answer.
        if ((res.statusCode ?? 0) >= 300) {
          bodyStarted = true;
          stream?.unpipe(req);
        }
        resolve({
          status: res.statusCode ?? 0,
          headers: res.headers,
          body: res,
          abort: () => {
            stream?.unpipe(req);
            stream?.destroy();
            req.destroy();
          },
        });
      });
      req.on('error', (err) => {
        clearTimeout(continueTimer);
        // After the answer, errors belong to its body (an upload the host stopped reading).
        if (!answered) reject(err);
      });
      req.on('socket', (socket) => {
        if (!socket.connecting || this.#connectTimeoutMs <= 0) return;
        const timer = setTimeout(() => {
          req.destroy(Object.assign(new Error(`no connection within ${this.#connectTimeoutMs} ms`), { code: 'ETIMEDOUT' }));
        }, this.#connectTimeoutMs);
        const clear = (): void => clearTimeout(timer);
        socket.once('connect', clear);
        socket.once('close', clear);
      });
      if (!expectContinue) {
        req.end(bytes);
        return;
      }
      if (stream !== undefined) {
        stream.once('error', (err) => {
          if (!answered) req.destroy(new SourceError(err));
          else req.destroy();
        });
        // A request that ends before its body was all sent (an abort, an early answer, a reset)
        // ends the source too: a directory being packed stops reading files.
        req.once('close', () => {
          if (!stream.readableEnded) stream.destroy();
        });
      }
      const sendBody = (): void => {
        if (bodyStarted) return;
        bodyStarted = true;
        clearTimeout(continueTimer);
        // Piped, not copied: the stream is read only as fast as the connection takes it.
        if (stream !== undefined) stream.pipe(req);
        else req.end(bytes);
      };
      req.on('continue', sendBody);
      req.flushHeaders();
      // A host (or proxy) that ignores `Expect` gets the body after a second, as curl does.
      continueTimer = setTimeout(sendBody, 1000);
    });
  }
}

/** Reads a body whole, failing past `max` bytes (or, with `truncate`, keeping the first `max`). */
export async function readBody(body: Readable, max: number, truncate: boolean): Promise<Buffer> {
  const parts: Buffer[] = [];
  let size = 0;
  for await (const chunk of body as AsyncIterable<Buffer>) {
    size += chunk.length;
    if (size > max) {
      if (truncate) {
        parts.push(chunk.subarray(0, chunk.length - (size - max)));
        body.destroy();
        break;
      }
      body.destroy();
      throw new RangeError(`the answer is larger than ${max} bytes`);
    }
    parts.push(chunk);
  }
  return Buffer.concat(parts);
}

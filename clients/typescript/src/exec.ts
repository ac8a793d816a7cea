/**
 * A running command: its output as it happens, read from the exec route's NDJSON stream one
 * line at a time, and its final status.
 *
 * Backpressure is end to end: a line is read from the socket only when the consumer asks for
 * the next chunk, so a slow consumer leaves the host's bounded channel full, the host stops
 * reading the command's pipe, and the command waits (docs/api.md, "Output is flow-controlled end
 * to end"). The client holds at most the socket's buffer and one line.
 */
import type { IncomingMessage } from 'node:http';

import { StreamCutError, UnexpectedAnswerError, errorFromAnswer } from './errors.js';
import { lines } from './ndjson.js';
import type { ExecExit } from './types.js';

/** One piece of output, as the guest's pipe gave it. */
export interface OutputChunk {
  /** Which of the command's outputs it came from. */
  stream: 'stdout' | 'stderr';
  /** The bytes (decoded from the line's base64). */
  data: Buffer;
}

/** A command's whole output and status (from `Execution.collect()`). */
export interface ExecResult {
  stdout: Buffer;
  stderr: Buffer;
  /** The last line: `exit_code`, `signal`, `timed_out`, `duration_ms`. */
  exit: ExecExit;
}

/** What an `Execution` needs from the sandbox that started it. */
export interface ExecContext {
  signal?: AbortSignal | undefined;
  /** Turns an error into the one to throw (the run's time limit, for a sandbox past it). */
  explain(err: unknown): unknown;
}

/**
 * The output and status of one exec. Iterate it once (`for await (const chunk of execution)`)
 * for the output as it happens, then `await execution.wait()` for the exit; or call `wait()`
 * alone (the output is read and dropped) or `collect()` (the output is kept).
 *
 * Leaving the loop early, `cancel()`, or aborting the signal closes the connection, and the
 * host then kills the command's process group.
 */
export class Execution implements AsyncIterable<OutputChunk> {
  readonly #response: IncomingMessage;
  readonly #context: ExecContext;
  #started = false;
  readonly #exit: Promise<ExecExit>;
  #settle!: { resolve(exit: ExecExit): void; reject(err: unknown): void };

  /** @internal Made by `Sandbox.exec` from the answer's body. */
  constructor(response: IncomingMessage, context: ExecContext) {
    this.#response = response;
    this.#context = context;
    this.#exit = new Promise<ExecExit>((resolve, reject) => {
      this.#settle = { resolve, reject };
    });
    // Nobody may ever ask for it (a caller that only iterates): no unhandled rejection then.
    this.#exit.catch(() => undefined);
  }

  /** The output chunks, in order, until the command ends. Can be iterated once. */
  [Symbol.asyncIterator](): AsyncIterator<OutputChunk> {
    if (this.#started) throw new Error('an Execution can be read once; use wait() for its exit');
    this.#started = true;
    return this.#read();
  }

  /** The command's exit. Reads (and drops) the output nobody iterated. */
  async wait(): Promise<ExecExit> {
    if (!this.#started) {
      for await (const chunk of this) void chunk;
    }
    return this.#exit;
  }

  /** The whole output and the exit, the output kept in memory (for commands with small output). */
  async collect(): Promise<ExecResult> {
    const out: Buffer[] = [];
    const err: Buffer[] = [];
    for await (const chunk of this) (chunk.stream === 'stdout' ? out : err).push(chunk.data);
    return { stdout: Buffer.concat(out), stderr: Buffer.concat(err), exit: await this.#exit };
  }

  /** Stops reading: the connection closes and the host kills the command. */
  cancel(): void {
    this.#response.destroy();
    this.#settle.reject(new StreamCutError('the exec was cancelled before its end'));
  }

  async *#read(): AsyncGenerator<OutputChunk, void, undefined> {
    let ended = false;
    try {
      for await (const raw of lines(this.#response)) {
        if (raw.length === 0) continue;
        const line = parse(raw);
        if ('stdout' in line) yield { stream: 'stdout', data: Buffer.from(line.stdout, 'base64') };
        else if ('stderr' in line) yield { stream: 'stderr', data: Buffer.from(line.stderr, 'base64') };
        else if ('exit_code' in line) {
          ended = true;
          this.#settle.resolve(line);
          return;
        } else {
          ended = true;
          // The status is 200 already: the error arrives as the last line (`bad_request` when
          // the command cannot start, `vm_died` when the VM failed midway).
          throw errorFromAnswer({ status: 200, code: line.code, message: line.error });
        }
      }
      ended = true;
      throw new StreamCutError('the exec stream ended without its last line (the exit or an error)');
    } catch (err) {
      const thrown = this.#context.signal?.aborted
        ? (this.#context.signal.reason ?? err)
        : this.#context.explain(ended ? err : new StreamCutError('the exec stream broke off', { cause: err }));
      this.#settle.reject(thrown);
      throw thrown;
    } finally {
      // Left early (a `break`), failed, or done: the connection goes; the host kills what runs.
      if (!ended) this.#settle.reject(new StreamCutError('the exec was left before its end'));
      this.#response.destroy();
    }
  }
}

type Line =
  | { stdout: string }
  | { stderr: string }
  | ExecExit
  | { error: string; code: string };

/** One NDJSON line, checked against the shapes of docs/api.md's exec stream. */
function parse(raw: Buffer): Line {
  let v: unknown;
  try {
    v = JSON.parse(raw.toString('utf8'));
  } catch (err) {
    throw new UnexpectedAnswerError({ status: 200, message: raw.subarray(0, 200).toString('utf8') }, 'an exec line that is not JSON');
  }
  if (typeof v === 'object' && v !== null) {
    const o = v as Record<string, unknown>;
    if (typeof o.stdout === 'string') return { stdout: o.stdout };
    if (typeof o.stderr === 'string') return { stderr: o.stderr };
    if ('exit_code' in o && typeof o.timed_out === 'boolean' && typeof o.duration_ms === 'number') {
      return {
        exit_code: typeof o.exit_code === 'number' ? o.exit_code : null,
        signal: typeof o.signal === 'number' ? o.signal : null,
        timed_out: o.timed_out,
        duration_ms: o.duration_ms,
      };
    }
    if (typeof o.error === 'string' && typeof o.code === 'string') return { error: o.error, code: o.code };
  }
  throw new UnexpectedAnswerError({ status: 200, message: raw.subarray(0, 200).toString('utf8') }, 'an exec line of no known shape');
}

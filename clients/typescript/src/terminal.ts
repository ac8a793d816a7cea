/**
 * A terminal in a sandbox's guest (`GET /v1/sandboxes/{id}/pty`): a WebSocket framed as
 * Kubernetes' exec streams, each binary message's first byte its channel (0 input, 1 output,
 * 3 the end, 4 a new size). What a person's browser terminal (xterm.js) needs from the server:
 * bytes in, bytes out, resize, and how it ended.
 */
import type WebSocket from 'ws';

import type { TerminalStatus } from './types.js';

/** The largest input message the host takes; longer input is sent in pieces of this size. */
export const MAX_INPUT_MESSAGE = 256 * 1024 - 1;

/**
 * An open terminal. Read its output with `for await` (chunks of bytes, as the guest wrote them:
 * a terminal's escape sequences included); `exited` resolves with how the session ended once it
 * has. Closing it (or leaving the sandbox) ends the session and kills what it started.
 */
export class Terminal implements AsyncIterable<Uint8Array> {
  /** How the session ended: the process's exit, or `error` and `code` when the session failed. */
  readonly exited: Promise<TerminalStatus>;
  readonly #ws: WebSocket;
  readonly #chunks: Uint8Array[] = [];
  #wake: (() => void) | undefined;
  #ended = false;

  /** @internal Made by `Sandbox.terminal`. */
  constructor(ws: WebSocket) {
    this.#ws = ws;
    let settle: (s: TerminalStatus) => void = () => {};
    this.exited = new Promise<TerminalStatus>((resolve) => {
      settle = resolve;
    });
    let status: TerminalStatus | undefined;
    ws.on('message', (data: Buffer, isBinary: boolean) => {
      if (!isBinary || data.length === 0) return;
      if (data[0] === 1) {
        this.#chunks.push(data.subarray(1));
        // Output not read yet: the socket stops being read until it is (the host's output then
        // waits for the window, and the guest's program for the terminal).
        if (this.#chunks.length > 64) ws.pause();
        this.#notify();
      } else if (data[0] === 3) {
        try {
          status = JSON.parse(data.subarray(1).toString('utf8')) as TerminalStatus;
        } catch {
          status = { status: 'Failure', error: 'the end of the terminal was not JSON', code: 'internal' };
        }
      }
    });
    ws.on('close', (code: number) => {
      this.#ended = true;
      this.#notify();
      settle(
        status ?? {
          status: 'Failure',
          error: `the terminal closed (WebSocket code ${code}) without saying how its command ended`,
          code: 'stream_cut',
        },
      );
    });
    ws.on('error', () => {
      // A 'close' follows, which settles `exited`.
    });
  }

  /** Types `data` into the terminal (a string is sent as UTF-8). */
  write(data: string | Uint8Array): void {
    const bytes = typeof data === 'string' ? Buffer.from(data, 'utf8') : Buffer.from(data);
    for (let at = 0; at < bytes.length; at += MAX_INPUT_MESSAGE) {
      const piece = bytes.subarray(at, at + MAX_INPUT_MESSAGE);
      this.#ws.send(Buffer.concat([Buffer.from([0]), piece]));
    }
  }

  /** Gives the terminal a new size (its foreground program gets SIGWINCH). */
  resize(rows: number, cols: number): void {
    this.#ws.send(Buffer.concat([Buffer.from([4]), Buffer.from(JSON.stringify({ Width: cols, Height: rows }), 'utf8')]));
  }

  /** Ends the session: its processes in the guest are killed. */
  close(): void {
    this.#ws.close(1000);
  }

  #notify(): void {
    const wake = this.#wake;
    this.#wake = undefined;
    wake?.();
  }

  async *[Symbol.asyncIterator](): AsyncIterator<Uint8Array> {
    for (;;) {
      const chunk = this.#chunks.shift();
      if (chunk !== undefined) {
        if (this.#chunks.length <= 16) this.#ws.resume();
        yield chunk;
        continue;
      }
      if (this.#ended) return;
      await new Promise<void>((resolve) => {
        this.#wake = resolve;
      });
    }
  }
}

/**
 * The keepalive loop. The host disposes of a sandbox that gets no request for
 * `SANDBOX_HOST_IDLE_MS` (5 minutes by default); the server holds a sandbox across long idle
 * gaps (the model thinking, a review waiting), so it sends a keepalive each minute while it holds
 * one (operator guide: "The server sends a keepalive each minute while it holds a sandbox").
 * Only the sandbox of a stopped server then reaches the idle limit.
 *
 * The loop stops with the sandbox: when it is disposed of, and when a keepalive finds it gone
 * (`no_sandbox`, `vm_died`, the run's time limit). A keepalive that fails otherwise (the host did
 * not answer) is reported and the loop carries on: the next one may get through well within the
 * idle limit. Its timer does not keep the process alive.
 */

/** The guide's interval: one keepalive a minute. */
export const KEEPALIVE_INTERVAL_MS = 60_000;

/** How the loop is run. */
export interface KeepaliveOptions {
  /** Between two keepalives (default 60 000 ms, the guide's minute). */
  intervalMs?: number | undefined;
  /** Told of each keepalive that failed; `stopped` is true when the loop ended because of it. */
  onError?: ((error: unknown, stopped: boolean) => void) | undefined;
}

/** What the loop calls: one keepalive, and whether an error means the sandbox is gone. */
export interface KeepaliveTarget {
  keepalive(signal: AbortSignal): Promise<void>;
  /** Whether the sandbox is paused by this client now (a paused sandbox has no idle timer). */
  isPaused(): boolean;
  /** Whether this error means the sandbox no longer exists (the loop then stops). */
  isTerminal(error: unknown): boolean;
}

/** A running keepalive loop. */
export class KeepaliveLoop {
  readonly #target: KeepaliveTarget;
  readonly #intervalMs: number;
  readonly #onError: KeepaliveOptions['onError'];
  readonly #abort = new AbortController();
  #timer: NodeJS.Timeout | undefined;
  #sent = 0;

  /** @internal Started by `Sandbox.startKeepalive`. */
  constructor(target: KeepaliveTarget, options: KeepaliveOptions = {}) {
    this.#target = target;
    this.#intervalMs = options.intervalMs ?? KEEPALIVE_INTERVAL_MS;
    if (!(this.#intervalMs > 0)) throw new RangeError('the keepalive interval must be above 0 ms');
    this.#onError = options.onError;
    this.#schedule();
  }

  /** Whether the loop still runs. */
  get running(): boolean {
    return !this.#abort.signal.aborted;
  }

  /** Keepalives sent so far (those that got their `204`). */
  get sent(): number {
    return this.#sent;
  }

  /** Stops the loop; a keepalive in flight is abandoned. */
  stop(): void {
    if (this.#timer !== undefined) clearTimeout(this.#timer);
    this.#timer = undefined;
    this.#abort.abort();
  }

  #schedule(): void {
    if (!this.running) return;
    // One timer after the other (never two keepalives at once); unref'd, so a server shutting
    // down is not kept up by it.
    this.#timer = setTimeout(() => void this.#tick(), this.#intervalMs);
    this.#timer.unref();
  }

  async #tick(): Promise<void> {
    if (!this.running) return;
    if (!this.#target.isPaused()) {
      try {
        await this.#target.keepalive(this.#abort.signal);
        this.#sent++;
      } catch (err) {
        if (!this.running) return;
        const terminal = this.#target.isTerminal(err);
        if (terminal) this.stop();
        try {
          this.#onError?.(err, terminal);
        } catch {
          // A failing listener must not end the loop.
        }
      }
    }
    this.#schedule();
  }
}

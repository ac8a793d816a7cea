/**
 * One error class per way a call can fail, each with the message the operator guide
 * (docs/operator-guide.md, "How to find a fault", and the platform's "Agent sandbox" page) gives
 * for it: the server shows `error.message` at the delegate control as it is, so the words a
 * person reads are the words the guide's table is searched by.
 *
 * The host's own `error` text is kept as `hostMessage`, its status and code as `status` and
 * `code`; `instanceof` tells the cases apart.
 */
import type { ErrorCode } from './types.js';

/** What the host answered with, for an error built from its answer. */
export interface HostAnswer {
  /** HTTP status. */
  status: number;
  /** The `code` of its JSON error, when it sent one. */
  code?: string | undefined;
  /** The `error` of its JSON error (or the start of its body), when it sent one. */
  message?: string | undefined;
}

/** The base of every error this client throws (aborts aside: those throw the signal's reason). */
export class SandboxHostError extends Error {
  /** The HTTP status, when the host answered. */
  readonly status: number | undefined;
  /** The API's error code, when the host sent one. */
  readonly code: string | undefined;
  /** The host's own words (its JSON `error`), when it sent some. */
  readonly hostMessage: string | undefined;

  constructor(message: string, answer?: HostAnswer, options?: { cause?: unknown }) {
    super(message, options);
    this.name = new.target.name;
    this.status = answer?.status;
    this.code = answer?.code;
    this.hostMessage = answer?.message;
  }
}

/** The host's text with a capital first letter, as a sentence shown to a person. */
function sentence(text: string | undefined, fallback: string): string {
  const t = (text ?? '').trim();
  if (t === '') return fallback;
  return t.charAt(0).toUpperCase() + t.slice(1);
}

/** Guide: the server has no `SANDBOX_HOST_URL` or no `SANDBOX_HOST_TOKEN`. Set both. */
export class NotConfiguredError extends SandboxHostError {
  /** Which of the two settings is missing (or, for `url`, not an http(s) URL). */
  readonly missing: ReadonlyArray<'url' | 'token'>;
  constructor(missing: ReadonlyArray<'url' | 'token'>) {
    super('No sandbox host is configured');
    this.missing = missing;
  }
}

/**
 * Guide: the sandbox host does not run, or the address is wrong (in a container, 127.0.0.1 is
 * the container itself). Thrown when no answer came: the connection was refused, the name did
 * not resolve, the connection did not open within `connectTimeoutMs`, or it closed before the
 * host answered.
 */
export class HostUnreachableError extends SandboxHostError {
  /** The configured address of the host. */
  readonly url: string;
  constructor(url: string, options?: { cause?: unknown }) {
    super(`The sandbox host at ${url} did not answer`, undefined, options);
    this.url = url;
  }
}

/** Guide: the two tokens are different (`401 unauthorized`). Set the same `SANDBOX_HOST_TOKEN` for both. */
export class TokenRefusedError extends SandboxHostError {
  constructor(answer: HostAnswer) {
    super("The sandbox host refused the server's token", answer);
  }
}

/**
 * `403 foreign_host`: the host listens on loopback and the request's `Host` header named
 * another name (a proxy, a browser page). Call it as `127.0.0.1` or `localhost`.
 */
export class ForeignHostError extends SandboxHostError {
  constructor(answer: HostAnswer) {
    super(
      `The sandbox host refused the request's Host header: call it as 127.0.0.1 or localhost, or bind it to another address (${answer.message ?? 'foreign_host'})`,
      answer,
    );
  }
}

/** `400 bad_request`: a request the host refused as written; the message says what is wrong. */
export class BadRequestError extends SandboxHostError {
  constructor(answer: HostAnswer) {
    super(sentence(answer.message, 'The sandbox host refused the request as malformed'), answer);
  }
}

/**
 * `404 no_sandbox`: the host has no sandbox with this id: it was deleted, idle for
 * `SANDBOX_HOST_IDLE_MS`, past its run's time limit, its VM died, or the host restarted.
 */
export class NoSandboxError extends SandboxHostError {
  constructor(answer: HostAnswer) {
    super(sentence(answer.message, 'The sandbox host has no such sandbox'), answer);
  }
}

/** `404 not_found`: a path that does not exist in the guest (or a route the host does not serve). */
export class NotFoundError extends SandboxHostError {
  constructor(answer: HostAnswer) {
    super(sentence(answer.message, 'Not found in the sandbox'), answer);
  }
}

/** `405 method_not_allowed`: a bug of this client against another version of the host. */
export class MethodNotAllowedError extends SandboxHostError {
  constructor(answer: HostAnswer) {
    super(sentence(answer.message, 'The sandbox host does not take this method on this route'), answer);
  }
}

/** `409 path_refused`: the guest's kernel refused the path as the guest's files are now. */
export class PathRefusedError extends SandboxHostError {
  constructor(answer: HostAnswer) {
    super(sentence(answer.message, 'The guest refused the path'), answer);
  }
}

/** `409 paused`: the sandbox is paused; resume it first. */
export class PausedError extends SandboxHostError {
  constructor(answer: HostAnswer) {
    super(sentence(answer.message, 'The sandbox is paused; resume it first'), answer);
  }
}

/** `409 conflict`: a pause or resume that cannot be done now (QEMU backend, or a request running). */
export class ConflictError extends SandboxHostError {
  constructor(answer: HostAnswer) {
    super(sentence(answer.message, 'The sandbox cannot be paused or resumed now'), answer);
  }
}

/**
 * `410 vm_died`, or an exec stream's last line with code `vm_died`: the sandbox's VM stopped
 * on its own (guest kernel panic, out of memory, a guest that stopped answering). The run needs
 * a new sandbox; `reason` has the host's reason and the last console lines.
 */
export class VmDiedError extends SandboxHostError {
  /** Why the VM stopped, with its last console lines. */
  readonly reason: string;
  constructor(answer: HostAnswer) {
    const prefix = "the sandbox's VM stopped: ";
    const text = answer.message ?? '';
    const reason = text.startsWith(prefix) ? text.slice(prefix.length) : text;
    super(`The sandbox's VM stopped: ${reason || 'no reason given'}`, answer);
    this.reason = reason;
  }
}

/**
 * `413 body_too_large`. Guide: the checkout is larger than `SANDBOX_HOST_MAX_BODY_MB`; increase
 * it for the sandbox host, then restart it. `limitBytes` and `limitMb` are the host's limit.
 */
export class BodyTooLargeError extends SandboxHostError {
  /** The host's limit in bytes, from its answer (undefined if the answer did not say). */
  readonly limitBytes: number | undefined;
  /** `SANDBOX_HOST_MAX_BODY_MB`, from its answer. */
  readonly limitMb: number | undefined;
  constructor(answer: HostAnswer) {
    const m = /larger than (\d+) bytes(?: \(SANDBOX_HOST_MAX_BODY_MB=(\d+)\))?/.exec(answer.message ?? '');
    const bytes = m?.[1] !== undefined ? Number(m[1]) : undefined;
    const mb = m?.[2] !== undefined ? Number(m[2]) : undefined;
    // The host's limit comes with its setting; another limit (a fleet's gateway reading a
    // create to place it) says its own words, kept as they are.
    super(
      bytes !== undefined && mb !== undefined
        ? `The request body is larger than ${bytes} bytes (SANDBOX_HOST_MAX_BODY_MB=${mb}); increase SANDBOX_HOST_MAX_BODY_MB for the sandbox host`
        : sentence(answer.message, 'The request body is larger than the sandbox host accepts; increase SANDBOX_HOST_MAX_BODY_MB for the sandbox host'),
      answer,
    );
    this.limitBytes = bytes;
    this.limitMb = mb;
  }
}

/** `500 internal`: the microVM did not boot (with why), or the guest agent failed. */
export class InternalError extends SandboxHostError {
  constructor(answer: HostAnswer) {
    super(sentence(answer.message, 'The sandbox host failed'), answer);
  }
}

/**
 * `503 unavailable`: this host cannot start microVMs; `reason` is the one of its `Listening on`
 * log line and of `GET /v1/health` (no QEMU, no image, a jail that cannot be applied, ...).
 */
export class UnavailableError extends SandboxHostError {
  /** Why the host cannot start microVMs. */
  readonly reason: string;
  constructor(answer: HostAnswer) {
    const prefix = 'the sandbox host cannot start a microVM: ';
    const text = answer.message ?? '';
    const reason = text.startsWith(prefix) ? text.slice(prefix.length) : text;
    super(`The sandbox host cannot start a microVM: ${reason || 'no reason given'}`, answer);
    this.reason = reason;
  }
}

/**
 * `503 no_capacity`: the sandbox would overcommit the host's guest memory, disk or file
 * descriptors (`reason` says which). Retry when a sandbox ends, or place the run on another host.
 */
export class NoCapacityError extends SandboxHostError {
  /** Which budget is full, in the host's words. */
  readonly reason: string;
  constructor(answer: HostAnswer) {
    const reason = answer.message ?? '';
    super(`The sandbox host has no capacity for this sandbox: ${reason || 'no reason given'}`, answer);
    this.reason = reason;
  }
}

/**
 * `503 host_restarting`: the sandbox host is stopping, or handing over to its next run (an
 * upgrade). A create: retry in a few seconds, or on another host. As an exec stream's last line:
 * the command keeps running in the sandbox, which the host's next run takes on again; read its
 * results from the files it writes once the host answers again.
 */
export class HostRestartingError extends SandboxHostError {
  constructor(answer: HostAnswer) {
    super(sentence(answer.message, 'The sandbox host is restarting'), answer);
  }
}

/**
 * `503 host_unavailable`, from a fleet's gateway (`sandbox-host gateway`): the sandbox host that
 * holds the sandbox did not answer (it is down or unreachable), or stopped answering during a
 * create. The sandbox may come back with its host; a new sandbox goes to another host.
 */
export class HostUnavailableError extends SandboxHostError {
  constructor(answer: HostAnswer) {
    super(sentence(answer.message, 'The sandbox host that holds the sandbox did not answer'), answer);
  }
}

/**
 * `502 port_closed`: nothing in the guest accepts connections on the port a request is for (or
 * its server did not answer as HTTP/1.1). Start the server in the sandbox first, listening on
 * 127.0.0.1 or 0.0.0.0.
 */
export class PortClosedError extends SandboxHostError {
  constructor(answer: HostAnswer) {
    super(sentence(answer.message, "Nothing listens on that port in the sandbox"), answer);
  }
}

/** `403 link_refused`: a signed link to a guest's port that is malformed, forged or expired. Ask for a new one. */
export class LinkRefusedError extends SandboxHostError {
  constructor(answer: HostAnswer) {
    super(sentence(answer.message, 'The link to the sandbox\'s port was refused'), answer);
  }
}

/** `507 no_space`: the guest's filesystem has no room for the archive or file. */
export class NoSpaceError extends SandboxHostError {
  constructor(answer: HostAnswer) {
    super(sentence(answer.message, "The sandbox's disk has no room left"), answer);
  }
}

/**
 * The run's time limit passed: the host disposed of the sandbox at `expires_at` plus
 * `SANDBOX_HOST_GRACE_MS` (a request then gets `no_sandbox`), or stopped it under a running
 * command. Thrown instead of those errors once the sandbox's `expires_at` has passed; the
 * host's own error is the `cause`.
 */
export class RunTimeLimitError extends SandboxHostError {
  /** When the run's time limit ended. */
  readonly expiresAt: Date;
  constructor(expiresAt: Date, options?: { cause?: unknown }) {
    super(
      `The run reached its time limit at ${expiresAt.toISOString()}; the sandbox host disposed of its sandbox`,
      undefined,
      options,
    );
    this.expiresAt = expiresAt;
  }
}

/**
 * The host's answer ended before it was complete: an exec stream without its last line, an
 * archive whose stream the host aborted (it aborts rather than ending cleanly on a failure).
 */
export class StreamCutError extends SandboxHostError {
  constructor(what: string, options?: { cause?: unknown }) {
    super(`The sandbox host's answer was cut off: ${what}`, undefined, options);
  }
}

/** An answer this client does not know: another status, an unknown code, or a body not JSON. */
export class UnexpectedAnswerError extends SandboxHostError {
  constructor(answer: HostAnswer, what: string) {
    super(`The sandbox host answered ${answer.status}${answer.code ? ` ${answer.code}` : ''}, ${what}${answer.message ? `: ${answer.message}` : ''}`, answer);
  }
}

/** A class of error built from the host's answer. */
export type AnswerErrorClass = new (answer: HostAnswer) => SandboxHostError;

/**
 * The class of each code. Typed over every code of docs/openapi.json (plus the 405 the service
 * also sends), so a code added to the contract fails the build until it has its class here.
 */
export const ERROR_CLASSES: { readonly [C in ErrorCode]: AnswerErrorClass } = {
  unauthorized: TokenRefusedError,
  foreign_host: ForeignHostError,
  bad_request: BadRequestError,
  no_sandbox: NoSandboxError,
  not_found: NotFoundError,
  method_not_allowed: MethodNotAllowedError,
  path_refused: PathRefusedError,
  paused: PausedError,
  conflict: ConflictError,
  vm_died: VmDiedError,
  body_too_large: BodyTooLargeError,
  internal: InternalError,
  unavailable: UnavailableError,
  no_capacity: NoCapacityError,
  host_restarting: HostRestartingError,
  host_unavailable: HostUnavailableError,
  no_space: NoSpaceError,
  port_closed: PortClosedError,
  link_refused: LinkRefusedError,
};

/** For an answer without a known code (a proxy's page, an older host): the class its status implies. */
const BY_STATUS: Readonly<Record<number, AnswerErrorClass>> = {
  400: BadRequestError,
  401: TokenRefusedError,
  405: MethodNotAllowedError,
  410: VmDiedError,
  413: BodyTooLargeError,
  500: InternalError,
  507: NoSpaceError,
};

/** The error an answer means: by its code, else by its status, else an unexpected answer. */
export function errorFromAnswer(answer: HostAnswer): SandboxHostError {
  const byCode = answer.code !== undefined && Object.hasOwn(ERROR_CLASSES, answer.code)
    ? ERROR_CLASSES[answer.code as ErrorCode]
    : undefined;
  const cls = byCode ?? (answer.code === undefined ? BY_STATUS[answer.status] : undefined);
  if (cls !== undefined) return new cls(answer);
  return new UnexpectedAnswerError(answer, answer.code === undefined ? 'not a JSON error of the API' : 'a code this client does not know');
}

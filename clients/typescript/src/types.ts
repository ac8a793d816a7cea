/**
 * The API's data as the client hands it over: names taken from the types generated from
 * docs/openapi.json (src/generated/openapi.ts, `npm run generate`), so that a change of the
 * contract changes these types and `npm run check-types` fails until the client follows.
 *
 * Objects keep the API's own field names (snake_case, as docs/api.md writes them): the server's
 * code and the host's documentation then read the same, and nothing is mapped by hand.
 */
import type { components, operations as Operations } from './generated/openapi.js';

/** The contract's schemas (docs/openapi.json `components.schemas`). */
export type Schemas = components['schemas'];

/** `GET /v1/health`: whether this host can start microVMs, its backend and its budgets. */
export type Health = Schemas['Health'];

/** The body of `POST /v1/sandboxes`: the run, its limits, image, environment and egress. */
export type CreateOptions = Schemas['CreateRequest'];

/** The run's egress settings: allowed hosts, secrets, metered hosts. */
export type EgressOptions = NonNullable<CreateOptions['egress']>;

/** One secret of a run: its variable, its real value (never shown to the guest), its hosts. */
export type Secret = Schemas['Secret'];

/** The answer to a create (`201`). */
export type Created = Schemas['Created'];

/** One child of a fork: its run (run id, time limit, env, egress); its machine is its parent's. */
export type ForkChild = Schemas['ForkChild'];

/** The answer to a fork (`201`): each child as a create answers it, and how long it took. */
export type Forked = Schemas['Forked'];

/**
 * One sandbox as `GET /v1/sandboxes` lists it.
 *
 * docs/openapi.json marks no field of its `Sandbox` schema as required, but the service's
 * `summary()` (api/src/routes/sandboxes.rs) always writes every field listed here; they are
 * required in this type so that the server's code need not test each one.
 */
export type SandboxSummary = Required<
  Pick<
    Schemas['Sandbox'],
    | 'id'
    | 'run_id'
    | 'state'
    | 'reason'
    | 'image'
    | 'stock_image'
    | 'memory_mib'
    | 'vcpus'
    | 'disk_limit_mib'
    | 'created_at'
    | 'last_activity_at'
    | 'expires_at'
    | 'boot_ms'
    | 'execs'
    | 'bytes_in'
    | 'bytes_out'
  >
> & {
  /** The run's egress settings without the secrets' values. */
  egress_settings: EgressSettings;
};

/** The egress settings a sandbox shows: what the create asked for, values left out. */
export interface EgressSettings {
  allow: string[];
  meter: string[];
  secrets: Array<{
    env: string;
    hosts: string[];
    headers: string[];
    /** `null`: the default (a known provider's inference endpoints, elsewhere any path). */
    paths: string[] | null;
    wildcard: boolean;
  }>;
  intercept: 'all' | 'secret_and_meter_hosts';
  meter_strict: boolean;
}

/** One sandbox as `GET /v1/sandboxes/{id}` shows it: the summary with egress and usage totals. */
export type SandboxDetail = SandboxSummary & {
  egress: Egress;
  usage: Usage['totals'];
};

/** `GET /v1/sandboxes/{id}/egress`: what the sandbox's egress stack refused and carried. */
export type Egress = Schemas['Egress'];

/** A reason the egress stack refused something (`name_not_allowed`, `placeholder_leak`, ...). */
export type EgressRefusalReason = Egress['events'][number]['reason'];

/** `GET /v1/sandboxes/{id}/usage`: the metered model calls and their totals. */
export type Usage = Schemas['Usage'];

/** One line of the exec stream, as the API writes it (base64 output, then the exit or an error). */
export type ExecLine = Schemas['ExecLine'];

/** The last line of a command that ended: its exit code or signal, whether its own timeout killed it. */
export type ExecExit = Extract<ExecLine, { exit_code: number | null }>;

/** `POST /v1/sandboxes/{id}/pause`'s answer (`pause_ms` absent when it was paused already). */
export type Paused = Operations['pauseSandbox']['responses'][200]['content']['application/json'];

/** `POST /v1/sandboxes/{id}/resume`'s answer (`resume_ms` absent when it was not paused). */
export type Resumed = Operations['resumeSandbox']['responses'][200]['content']['application/json'];

/** A code of the API's JSON errors, as docs/openapi.json lists them. */
export type ContractErrorCode = Schemas['Error']['code'];

/**
 * Every code the service can answer with: the contract's, and `method_not_allowed` (405), which
 * docs/api.md and the service (api/src/error.rs) have but docs/openapi.json's enum lacks.
 */
export type ErrorCode = ContractErrorCode | 'method_not_allowed';

/**
 * One line of `GET /v1/sandboxes/{id}/watch` (`Sandbox.watch`): the watch is set (`ready`), a
 * change, events lost because the reader fell behind (`overflow`: read the tree again), or the
 * end of a watch with a `timeoutMs`.
 */
export type WatchEvent =
  | { event: 'ready'; path: string; watches: number }
  | { event: 'create' | 'delete'; path: string; dir: boolean }
  | { event: 'modify'; path: string }
  | { event: 'rename'; from: string; to: string; dir: boolean }
  | { event: 'overflow'; reason: 'queue' | 'kernel' | 'watches'; dropped: number }
  | { event: 'end'; reason: 'timeout' };

/**
 * The last message of a terminal (`Sandbox.terminal`): how its process ended (`status` is
 * `Success` only for exit code 0), or `error` and `code` when the session failed.
 */
export type TerminalStatus = Schemas['TerminalStatus'];

/** `POST /v1/sandboxes/{id}/ports/{port}/url`'s answer (`Sandbox.portUrl`). */
export type PortLink = Schemas['PortLink'];

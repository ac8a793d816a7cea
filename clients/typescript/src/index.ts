/**
 * `@vantik/sandbox-host`: the typed client of the Vantik sandbox host's HTTP API
 * (docs/api.md), as the Vantik server uses it.
 *
 * @packageDocumentation
 */
export { SandboxHost, type SandboxHostOptions, type CreateCallOptions, type DisposeEndedResult } from './host.js';
export {
  Sandbox,
  type CallOptions,
  type ExecOptions,
  type PutArchiveOptions,
  type GetArchiveOptions,
  type WriteFileOptions,
  type WatchOptions,
  type TerminalOptions,
} from './sandbox.js';
export { Execution, type OutputChunk, type ExecResult } from './exec.js';
export { Terminal, MAX_INPUT_MESSAGE } from './terminal.js';
export { KeepaliveLoop, KEEPALIVE_INTERVAL_MS, type KeepaliveOptions } from './keepalive.js';
export { packDirectory, extractInto, type ByteSource, type ByteSink, type PackOptions, type ExtractOptions } from './archive.js';
export { DEFAULT_RETRY, type RetryOptions } from './transport.js';
export * from './errors.js';
export type * from './types.js';
/**
 * The types generated from docs/openapi.json (`npm run generate`), for what the aliases above
 * do not name. Left out of the reference: docs/openapi.json and docs/api.md document them.
 *
 * @hidden
 */
export type { components, operations, paths } from './generated/openapi.js';

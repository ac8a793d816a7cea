/**
 * The real `sandbox-host serve`, started the way api/tests/common/mod.rs starts it (its own
 * state directory, a free loopback port, no .env, templates off), for the flow test and the
 * benchmark. Never a fake: without the binary or the images they are skipped with the reason,
 * and under SANDBOX_HOST_REQUIRE_E2E=1 (CI) that reason is a failure instead.
 *
 * As root (CI), the service runs as the user `sandbox-host`, as the Rust tests run it
 * (`service_user()` and `service()` in common/mod.rs): `scripts/service-user.sh` hands it the
 * binaries, the image store and a cgroup under /var/lib/sandbox-host-tests once, and each start
 * moves the service into that cgroup and drops to the user with `setpriv`. As an ordinary user,
 * the service runs as that user.
 */
import { execFileSync, spawn, type ChildProcess } from 'node:child_process';
import { chmodSync, existsSync, mkdirSync, statSync } from 'node:fs';
import type { AddressInfo } from 'node:net';
import { createServer } from 'node:net';
import { homedir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { createInterface } from 'node:readline';
import { setTimeout as sleep } from 'node:timers/promises';
import { fileURLToPath } from 'node:url';

export const TOKEN = 'flow-test-token-0123456789abcdef';
export const GUEST_IMAGE = 'vantik-guest:latest';

/** SANDBOX_HOST_REQUIRE_E2E=1 (bin/test sets it): what would skip the flow fails it. */
export const REQUIRED = process.env.SANDBOX_HOST_REQUIRE_E2E === '1';

/** The user the documented setup runs the service as. */
export const SERVICE_USER = 'sandbox-host';
/** Where scripts/service-user.sh prepares the service's files for these tests (as the Rust tests). */
export const SERVICE_RUNTIME = '/var/lib/sandbox-host-tests';

function runningAsRoot(): boolean {
  return process.getuid?.() === 0;
}

function serviceUserKnown(): boolean {
  try {
    execFileSync('id', [SERVICE_USER], { stdio: 'ignore' });
    return true;
  } catch {
    return false;
  }
}

/** The repository's root (this file runs as build/test/real-host.js or from test/ in clients/typescript). */
function repoRoot(): string {
  const here = dirname(fileURLToPath(import.meta.url));
  for (const up of ['../../../..', '../../..']) {
    const root = resolve(here, up);
    if (existsSync(join(root, 'scripts', 'service-user.sh'))) return root;
  }
  throw new Error(`no scripts/service-user.sh above ${here}`);
}

/** The image store the host will read, as scripts/cache-dir.sh finds it (as root, the service
 * reads the copy scripts/service-user.sh publishes from it). */
export function imageStore(): string {
  if (process.env.SANDBOX_HOST_IMAGE_DIR) return process.env.SANDBOX_HOST_IMAGE_DIR;
  const cache = process.env.SANDBOX_HOST_CACHE ?? (process.env.XDG_CACHE_HOME ? join(process.env.XDG_CACHE_HOME, 'sandbox-host') : join(homedir(), '.cache', 'sandbox-host'));
  return join(cache, 'images');
}

/** Why the flow cannot run here, or undefined when it can. */
export function whySkipped(): string | undefined {
  const bin = process.env.SANDBOX_HOST_BIN;
  if (!bin) return 'SANDBOX_HOST_BIN is not set (the path of a built sandbox-host, e.g. ~/.cache/sandbox-host/target/debug/sandbox-host); the flow needs the real binary booting real VMs';
  if (!existsSync(bin)) return `SANDBOX_HOST_BIN=${bin} does not exist; build it with cargo build -p sandbox-host -p sandbox-vm -p sandbox-net --bins`;
  const store = imageStore();
  if (!existsSync(join(store, 'stock', 'manifest.json'))) return `no stock image in ${store}; run bash rootfs/build-stock.sh`;
  if (!existsSync(join(store, 'vantik-guest', 'latest'))) return `no ${GUEST_IMAGE} in ${store} (the flow runs git and node in the guest); build it with sudo python3 rootfs/build-guest.py`;
  try {
    execFileSync('git', ['--version'], { stdio: 'ignore' });
  } catch {
    return 'no git on this machine to make the checkout';
  }
  if (runningAsRoot() && !serviceUserKnown()) {
    const why = `no user ${SERVICE_USER} (scripts/install-deps.sh adds it)`;
    if (REQUIRED) return `${why}: CI runs the service as that user`;
    process.stderr.write(`running the service as an ordinary user is skipped: ${why}; it runs as root\n`);
  }
  return undefined;
}

/** What scripts/service-user.sh prepared for the service's user. */
export interface ServiceUser {
  /** SANDBOX_HOST_CACHE, SANDBOX_HOST_CGROUP, SANDBOX_HOST_VM_BINARY, ... */
  env: Record<string, string>;
  /** The binary to run: the runtime directory's link to SANDBOX_HOST_BIN. */
  binary: string;
  /** The published image store the service can read. */
  images: string;
  /** On cgroup v2, the procs file of the leaf the service is moved into before it drops to its user. */
  procs?: string;
  runtime: string;
}

let prepared: ServiceUser | null | undefined;

/**
 * The service's user when the tests run as root and the user `sandbox-host` exists, prepared
 * once by scripts/service-user.sh; undefined otherwise (the service then runs as whoever runs
 * the tests).
 */
export function serviceUser(): ServiceUser | undefined {
  if (prepared !== undefined) return prepared ?? undefined;
  if (!runningAsRoot() || !serviceUserKnown()) {
    prepared = null;
    return undefined;
  }
  const script = join(repoRoot(), 'scripts', 'service-user.sh');
  let out: string;
  try {
    out = execFileSync('bash', [script, '--cgroup', 'sandbox-host-tests', SERVICE_RUNTIME, process.env.SANDBOX_HOST_BIN!], {
      encoding: 'utf8',
      stdio: ['ignore', 'pipe', 'inherit'],
    });
  } catch (e) {
    throw new Error(`scripts/service-user.sh failed: ${(e as Error).message}`);
  }
  const env: Record<string, string> = {};
  let binary: string | undefined;
  let images: string | undefined;
  let procs: string | undefined;
  for (const line of out.split('\n')) {
    const eq = line.indexOf('=');
    if (eq <= 0) continue;
    const [k, v] = [line.slice(0, eq), line.slice(eq + 1)];
    if (k === 'SERVICE_BINARY') binary = v;
    else if (k === 'SERVICE_CGROUP_PROCS') procs = v;
    else if (k === 'SANDBOX_HOST_IMAGE_DIR') images = v;
    // Each host gets a state directory of its own.
    else if (k !== 'SANDBOX_HOST_STATE_DIR') env[k] = v;
  }
  if (binary === undefined) throw new Error('no SERVICE_BINARY from scripts/service-user.sh');
  if (images === undefined) throw new Error('no SANDBOX_HOST_IMAGE_DIR from scripts/service-user.sh');
  prepared = { env, binary, images, ...(procs !== undefined ? { procs } : {}), runtime: SERVICE_RUNTIME };
  return prepared;
}

/**
 * Makes `dir` (a host's state directory) and, as root, hands it to the service's user with its
 * parent passable (a temporary directory is its creator's alone), as give_to_service() does.
 */
export function giveToService(dir: string): void {
  mkdirSync(dir, { recursive: true });
  if (serviceUser() === undefined) return;
  const parent = dirname(dir);
  const mode = statSync(parent).mode & 0o7777;
  if ((mode & 0o001) === 0) chmodSync(parent, mode | 0o711);
  // The directory alone: root never follows what the service's user could have put in it.
  execFileSync('chown', [`${SERVICE_USER}:${SERVICE_USER}`, dir], { stdio: 'inherit' });
}

/** The command line and environment of `serve`: as the service's user when there is one. */
function serveCommand(state: string, port: number, env: Record<string, string>): { argv: string[]; env: Record<string, string> } {
  const u = serviceUser();
  if (u === undefined) {
    return {
      argv: [process.env.SANDBOX_HOST_BIN!, 'serve'],
      env: {
        PATH: process.env.PATH ?? '/usr/bin:/bin',
        HOME: process.env.HOME ?? '/root',
        ...(process.env.SANDBOX_HOST_CACHE ? { SANDBOX_HOST_CACHE: process.env.SANDBOX_HOST_CACHE } : {}),
        SANDBOX_HOST_DOTENV: '/nonexistent/.env',
        SANDBOX_HOST_TOKEN: TOKEN,
        SANDBOX_HOST_PORT: String(port),
        SANDBOX_HOST_STATE_DIR: state,
        SANDBOX_HOST_IMAGE_DIR: imageStore(),
        ...env,
      },
    };
  }
  const setpriv = ['/usr/bin/setpriv', '/bin/setpriv'].find((p) => existsSync(p));
  if (setpriv === undefined) throw new Error('no setpriv (util-linux) to start the service as its user');
  // As bin/up starts it: on cgroup v2 moved into its leaf first (the pid stays: `exec`), then the
  // user's ids, then a session of its own with no terminal.
  const argv = [
    ...(u.procs !== undefined ? ['/bin/sh', '-c', 'echo $$ > "$0" && exec "$@"', u.procs] : []),
    setpriv,
    '--reuid',
    SERVICE_USER,
    '--regid',
    SERVICE_USER,
    '--init-groups',
    '--',
    '/usr/bin/setsid',
    u.binary,
    'serve',
  ];
  // Only the service's own settings of the environment, as service() keeps them.
  const kept: Record<string, string> = {};
  for (const [k, v] of Object.entries(process.env)) {
    if (v === undefined) continue;
    if (k.startsWith('SANDBOX_HOST_') || ['PATH', 'LANG', 'LC_ALL', 'TZ', 'RUST_LOG', 'RUST_BACKTRACE'].includes(k)) kept[k] = v;
  }
  delete kept.SANDBOX_HOST_TOKEN;
  delete kept.SANDBOX_HOST_PORT;
  return {
    argv,
    env: {
      ...kept,
      HOME: u.runtime,
      SANDBOX_HOST_DOTENV: '/nonexistent/.env',
      ...u.env,
      SANDBOX_HOST_TOKEN: TOKEN,
      SANDBOX_HOST_PORT: String(port),
      SANDBOX_HOST_STATE_DIR: state,
      SANDBOX_HOST_IMAGE_DIR: u.images,
      ...env,
    },
  };
}

export async function freePort(): Promise<number> {
  const s = createServer();
  await new Promise<void>((resolve) => s.listen(0, '127.0.0.1', () => resolve()));
  const { port } = s.address() as AddressInfo;
  await new Promise<void>((resolve) => s.close(() => resolve()));
  return port;
}

/** A running `sandbox-host serve`, its log lines kept. */
export interface RealHost {
  child: ChildProcess;
  url: string;
  logs: string[];
}

/** Hosts still running when the process exits are killed then (a last resort: `stopHost` is the way). */
const running = new Set<ChildProcess>();
process.once('exit', () => {
  for (const child of running) child.kill('SIGKILL');
});

/** Starts `serve` on `state` (made, and as root handed to the service's user) and waits for its `Listening on` line. */
export async function startHost(state: string, env: Record<string, string>): Promise<RealHost> {
  const port = await freePort();
  giveToService(state);
  const cmd = serveCommand(state, port, env);
  const child = spawn(cmd.argv[0]!, cmd.argv.slice(1), { env: cmd.env, stdio: ['ignore', 'ignore', 'pipe'] });
  running.add(child);
  child.once('exit', () => running.delete(child));
  const logs: string[] = [];
  const listening = new Promise<void>((resolve, reject) => {
    const rl = createInterface({ input: child.stderr! });
    rl.on('line', (line) => {
      logs.push(line);
      if (line.includes('Listening on')) resolve();
    });
    child.once('error', (e) => reject(new Error(`${cmd.argv[0]} did not start: ${e.message}`)));
    child.once('exit', (code, signal) => reject(new Error(`sandbox-host exited with ${code ?? signal} before listening:\n${logs.slice(-20).join('\n')}`)));
  });
  // The wait is bounded, and its timer goes once the host listens (it would keep the test alive).
  const bound = new AbortController();
  const timeout = sleep(180_000, undefined, { signal: bound.signal }).then(() => {
    throw new Error(`no Listening on line within 180 s:\n${logs.slice(-20).join('\n')}`);
  });
  timeout.catch(() => undefined);
  const host = { child, url: `http://127.0.0.1:${port}`, logs };
  try {
    await Promise.race([listening, timeout]);
  } catch (e) {
    // A host that did not come up is not left running.
    await stopHost(host);
    throw e;
  } finally {
    bound.abort();
  }
  return host;
}

/** Stops a host this process started (SIGTERM: it disposes of its sandboxes), SIGKILL after 30 s. */
export async function stopHost(host: RealHost): Promise<void> {
  if (host.child.pid === undefined || host.child.exitCode !== null || host.child.signalCode !== null) return;
  const exited = new Promise((resolve) => host.child.once('exit', resolve));
  host.child.kill('SIGTERM');
  const bound = new AbortController();
  await Promise.race([exited, sleep(30_000, undefined, { signal: bound.signal }).catch(() => undefined)]);
  bound.abort();
  if (host.child.exitCode === null && host.child.signalCode === null) host.child.kill('SIGKILL');
}

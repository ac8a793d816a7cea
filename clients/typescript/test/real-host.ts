/**
 * The real `sandbox-host serve`, started the way api/tests/common/mod.rs starts it (its own
 * state directory, a free loopback port, no .env, templates off), for the flow test and the
 * benchmark. Never a fake: without the binary or the images they are skipped with the reason.
 */
import { execFileSync, spawn, type ChildProcess } from 'node:child_process';
import { existsSync } from 'node:fs';
import type { AddressInfo } from 'node:net';
import { createServer } from 'node:net';
import { homedir } from 'node:os';
import { join } from 'node:path';
import { createInterface } from 'node:readline';
import { setTimeout as sleep } from 'node:timers/promises';

export const TOKEN = 'flow-test-token-0123456789abcdef';
export const GUEST_IMAGE = 'vantik-guest:latest';

/** The image store the host will read, as scripts/cache-dir.sh finds it. */
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
  return undefined;
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

export async function startHost(state: string, env: Record<string, string>): Promise<RealHost> {
  const port = await freePort();
  const child = spawn(process.env.SANDBOX_HOST_BIN!, ['serve'], {
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
    stdio: ['ignore', 'ignore', 'pipe'],
  });
  const logs: string[] = [];
  const listening = new Promise<void>((resolve, reject) => {
    const rl = createInterface({ input: child.stderr! });
    rl.on('line', (line) => {
      logs.push(line);
      if (line.includes('Listening on')) resolve();
    });
    child.once('exit', (code) => reject(new Error(`sandbox-host exited with ${code} before listening:\n${logs.slice(-20).join('\n')}`)));
  });
  // The wait is bounded, and its timer goes once the host listens (it would keep the test alive).
  const bound = new AbortController();
  const timeout = sleep(180_000, undefined, { signal: bound.signal }).then(() => {
    throw new Error(`no Listening on line within 180 s:\n${logs.slice(-20).join('\n')}`);
  });
  timeout.catch(() => undefined);
  try {
    await Promise.race([listening, timeout]);
  } finally {
    bound.abort();
  }
  return { child, url: `http://127.0.0.1:${port}`, logs };
}

/** Stops a host this process started (SIGTERM: it disposes of its sandboxes), SIGKILL after 30 s. */
export async function stopHost(host: RealHost): Promise<void> {
  if (host.child.exitCode !== null || host.child.signalCode !== null) return;
  const exited = new Promise((resolve) => host.child.once('exit', resolve));
  host.child.kill('SIGTERM');
  const bound = new AbortController();
  await Promise.race([exited, sleep(30_000, undefined, { signal: bound.signal }).catch(() => undefined)]);
  bound.abort();
  if (host.child.exitCode === null && host.child.signalCode === null) host.child.kill('SIGKILL');
}

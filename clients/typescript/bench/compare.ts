/**
 * The client's added cost against plain curl on the real host (issue 34, "How to show it"):
 * an exec round trip (`true`, to its exit line), and archive throughput both ways. Not a test:
 * run it by hand on a quiet machine, with the binary and the images the flow test needs:
 *
 *   npm run pretest && SANDBOX_HOST_BIN=... node build/bench/compare.js [rounds] [archive MiB]
 *
 * curl runs every request of a series in one process (`--next`) and reports each one's
 * `time_total`, so its numbers hold no process start-up; the client's are `performance.now()`
 * around each call. Medians (and the 90th percentile) of each series are printed side by side.
 */
import { execFile } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { mkdir, mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Writable } from 'node:stream';
import { promisify } from 'node:util';

import { SandboxHost } from '../src/index.js';
import { GUEST_IMAGE, TOKEN, startHost, stopHost, whySkipped } from '../test/real-host.js';

const run = promisify(execFile);
const rounds = Number(process.argv[2] ?? 40);
const archiveMiB = Number(process.argv[3] ?? 256);

function stats(ms: number[]): string {
  const s = [...ms].sort((a, b) => a - b);
  const at = (q: number): number => s[Math.min(s.length - 1, Math.floor(q * s.length))]!;
  return `median ${at(0.5).toFixed(2)} ms, p90 ${at(0.9).toFixed(2)} ms`;
}

/** Runs curl with one request per `args` group, sequentially in one process; each one's time in ms. */
async function curlSeries(groups: string[][]): Promise<number[]> {
  const args: string[] = [];
  groups.forEach((g, i) => {
    if (i > 0) args.push('--next');
    args.push('-sS', '-o', '/dev/null', '-w', '%{time_total} %{http_code}\\n', '-H', `authorization: Bearer ${TOKEN}`, ...g);
  });
  const { stdout } = await run('curl', args, { maxBuffer: 64 * 1024 * 1024 });
  return stdout
    .trim()
    .split('\n')
    .map((l) => {
      const [t, code] = l.split(' ');
      if (!code?.startsWith('2')) throw new Error(`curl got ${code}`);
      return Number(t) * 1000;
    });
}

async function main(): Promise<void> {
  const skip = whySkipped();
  if (skip !== undefined) {
    console.log(`skipped: ${skip}`);
    return;
  }
  const work = await mkdtemp(join(tmpdir(), 'sbx-bench-'));
  await mkdir(join(work, 'state'));
  const real = await startHost(join(work, 'state'), { SANDBOX_HOST_TEMPLATES: 'off', SANDBOX_HOST_MAX_BODY_MB: String(4 * archiveMiB) });
  const host = new SandboxHost({ url: real.url, token: TOKEN });
  try {
    const health = await host.ready();
    const sb = await host.create({ run_id: 'bench', time_limit_ms: 3_600_000, review: false, memory_mib: 2048, vcpus: 2, image: GUEST_IMAGE });
    const exec = `${real.url}/v1/sandboxes/${sb.id}/exec`;
    console.log(`host: backend ${health.backend}, accel ${health.accel}; ${rounds} rounds; archive ${archiveMiB} MiB`);

    // Exec round trip: warm both, then alternate series.
    await (await sb.exec(['true'])).wait();
    const client: number[] = [];
    for (let i = 0; i < rounds; i++) {
      const t0 = performance.now();
      await (await sb.exec(['true'])).wait();
      client.push(performance.now() - t0);
    }
    const curl = await curlSeries(Array.from({ length: rounds }, () => ['-X', 'POST', '-H', 'content-type: application/json', '--data', '{"argv":["true"]}', exec]));
    console.log(`exec true, round trip: client ${stats(client)} | curl ${stats(curl)}`);

    // Archives: a directory of incompressible files.
    const dir = join(work, 'tree');
    await mkdir(dir);
    const fileMiB = 16;
    for (let i = 0; i < archiveMiB / fileMiB; i++) await writeFile(join(dir, `f${i}.bin`), randomBytes(fileMiB * 1024 * 1024));
    const tarFile = join(work, 'tree.tar');
    await run('tar', ['-C', dir, '-cf', tarFile, '.']);
    const archive = `${real.url}/v1/sandboxes/${sb.id}/archive?path=/workspace/bench`;
    const mibps = (ms: number): string => `${(archiveMiB / (ms / 1000)).toFixed(0)} MiB/s`;
    const up: number[] = [];
    const down: number[] = [];
    for (let i = 0; i < 3; i++) {
      let t0 = performance.now();
      await sb.putArchive(dir, '/workspace/bench');
      up.push(performance.now() - t0);
      t0 = performance.now();
      await sb.getArchive(
        '/workspace/bench',
        new Writable({
          write(_c, _e, cb) {
            cb();
          },
        }),
      );
      down.push(performance.now() - t0);
    }
    const curlUp = await curlSeries(Array.from({ length: 3 }, () => ['-X', 'PUT', '-H', 'content-type: application/x-tar', '--data-binary', `@${tarFile}`, archive]));
    const curlDown = await curlSeries(Array.from({ length: 3 }, () => [archive]));
    const best = (xs: number[]): number => Math.min(...xs);
    console.log(`putArchive (client packs the directory as it sends): best ${mibps(best(up))} | curl --data-binary @tree.tar: best ${mibps(best(curlUp))}`);
    console.log(`getArchive (to a null stream): best ${mibps(best(down))} | curl -o /dev/null: best ${mibps(best(curlDown))}`);
    await sb.dispose();
  } finally {
    await stopHost(real);
    await rm(work, { recursive: true, force: true });
  }
}

await main();

/**
 * The server's whole call pattern against the real sandbox host booting real VMs (issue 34,
 * item 2), through this client only: a git checkout made here sent as the archive with the
 * prompt and the issue's context as files; `git status` and a small project's tests run in the
 * guest with their output streamed; the keepalive loop holding a sandbox across an idle gap
 * longer than SANDBOX_HOST_IDLE_MS while one without it is disposed of; the tree read back and
 * compared with what the commands changed; usage, egress refusals and the host's refusals read;
 * a "restarted server" disposing of an ended run's sandbox and keeping the live one; the
 * sandbox disposed of.
 *
 * It starts `SANDBOX_HOST_BIN serve` itself (as api/tests/common/mod.rs does: as the user
 * `sandbox-host` when the tests run as root) and is skipped, saying why, when SANDBOX_HOST_BIN
 * is not set or the image store lacks what it needs; under SANDBOX_HOST_REQUIRE_E2E=1 (CI) it
 * fails instead. It never fakes the VM.
 */
import http from 'node:http';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { cp, mkdir, mkdtemp, readFile, readdir, rm, unlink, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { setTimeout as sleep } from 'node:timers/promises';

import {
  BadRequestError,
  BodyTooLargeError,
  ConflictError,
  NoSandboxError,
  NotFoundError,
  PausedError,
  SandboxHost,
  TokenRefusedError,
  type Sandbox,
} from '../src/index.js';
import { GUEST_IMAGE, REQUIRED, TOKEN, startHost, stopHost, whySkipped, type RealHost } from './real-host.js';

const IDLE_MS = 6000;
const MAX_BODY_MB = 8;

/** Why the flow cannot run here: a skip, or under SANDBOX_HOST_REQUIRE_E2E=1 a failure. */
const cannot = whySkipped();
const skip = REQUIRED ? undefined : cannot;
if (skip !== undefined) process.stderr.write(`skipped: ${skip}\n`);

async function git(cwd: string, ...args: string[]): Promise<string> {
  return execFileSync('git', args, { cwd, encoding: 'utf8', env: { ...process.env, GIT_AUTHOR_NAME: 't', GIT_AUTHOR_EMAIL: 't@t.invalid', GIT_COMMITTER_NAME: 't', GIT_COMMITTER_EMAIL: 't@t.invalid' } });
}

/** Every file under `dir` but .git, with its content. */
async function files(dir: string, base = ''): Promise<Record<string, string>> {
  const out: Record<string, string> = {};
  for (const e of await readdir(join(dir, base), { withFileTypes: true })) {
    const rel = base ? `${base}/${e.name}` : e.name;
    if (rel === '.git') continue;
    if (e.isDirectory()) Object.assign(out, await files(dir, rel));
    else out[rel] = await readFile(join(dir, rel), 'utf8');
  }
  return out;
}

/** Runs a shell command, streaming its output to an array as it happens; returns it and the exit code. */
async function run(sb: Sandbox, command: string, cwd = '/workspace/repo'): Promise<{ out: string; code: number | null; chunks: number }> {
  const ex = await sb.exec(command, { cwd, timeoutMs: 120_000 });
  let out = '';
  let chunks = 0;
  for await (const c of ex) {
    out += c.data.toString('utf8');
    chunks++;
  }
  return { out, code: (await ex.wait()).exit_code, chunks };
}

describe('the server\'s flow against the real sandbox host', () => {
  let work: string;
  let real: RealHost;
  let client: SandboxHost;
  const opened: Sandbox[] = [];

  before(async () => {
    if (skip !== undefined) return;
    if (cannot !== undefined) throw new Error(`SANDBOX_HOST_REQUIRE_E2E=1, and the flow cannot run: ${cannot}`);
    work = await mkdtemp(join(tmpdir(), 'sbx-flow-'));
    real = await startHost(join(work, 'state'), {
      SANDBOX_HOST_IDLE_MS: String(IDLE_MS),
      SANDBOX_HOST_SWEEP_MS: '200',
      SANDBOX_HOST_TEMPLATES: 'off',
      SANDBOX_HOST_MAX_BODY_MB: String(MAX_BODY_MB),
    });
    client = new SandboxHost({ url: real.url, token: TOKEN });
  });

  // Whatever failed: the sandboxes disposed of, the host stopped, the state directory removed.
  after(async () => {
    const t0 = Date.now();
    try {
      if (real !== undefined && real.child.exitCode === null && real.child.signalCode === null) {
        const bound = AbortSignal.timeout(60_000);
        for (const sb of opened) if (!sb.disposed) await sb.dispose({ signal: bound }).catch(() => undefined);
      }
    } finally {
      try {
        if (real !== undefined) await stopHost(real);
      } finally {
        if (work !== undefined) await rm(work, { recursive: true, force: true, maxRetries: 3 });
        process.stderr.write(`# clean-up took ${Date.now() - t0} ms\n`);
      }
    }
  });

  // The test is skipped (and counted so) rather than its suite, which node:test would not count.
  it('runs the whole flow', { timeout: 600_000, skip }, async () => {
    const health = await client.ready();
    process.stderr.write(`# host: backend ${health.backend}, accel ${health.accel}, image ${health.image.name}\n`);

    // The checkout: a small repository with a project and its tests, made here.
    const repo = join(work, 'repo');
    await mkdir(join(repo, 'src'), { recursive: true });
    await writeFile(join(repo, 'README.md'), '# flow\n');
    await writeFile(join(repo, 'src/add.mjs'), 'export const add = (a, b) => a + b;\n');
    await writeFile(
      join(repo, 'add.test.mjs'),
      "import { test } from 'node:test';\nimport assert from 'node:assert';\nimport { add } from './src/add.mjs';\ntest('adds', () => assert.equal(add(2, 3), 5));\n",
    );
    await git(repo, 'init', '-q', '-b', 'main');
    await git(repo, 'add', '-A');
    await git(repo, 'commit', '-q', '-m', 'start');

    // Create, as the server does: egress with a secret and a meter, the keepalive loop running.
    const keepaliveErrors: unknown[] = [];
    const sb = await client.create(
      {
        run_id: 'run-flow',
        time_limit_ms: 600_000,
        review: false,
        memory_mib: 1024,
        vcpus: 1,
        image: GUEST_IMAGE,
        env: { CI: '1' },
        egress: {
          allow: ['registry.npmjs.org'],
          secrets: [{ env: 'ANTHROPIC_API_KEY', value: 'sk-ant-flow-test-0123456789', hosts: ['api.anthropic.com'] }],
          meter: ['api.anthropic.com'],
        },
      },
      { keepalive: { intervalMs: 1000, onError: (e) => keepaliveErrors.push(e) } },
    );
    opened.push(sb);
    assert.equal(sb.created?.image, GUEST_IMAGE);
    // Two more: one the (old) server stops keeping alive, one of a run that ends.
    const idle = await client.create({ run_id: 'run-idle', time_limit_ms: 600_000, review: false, memory_mib: 256, vcpus: 1, image: 'stock' }, { keepalive: { intervalMs: 1000 } });
    const ended = await client.create({ run_id: 'run-ended', time_limit_ms: 600_000, review: false, memory_mib: 256, vcpus: 1, image: 'stock' }, { keepalive: { intervalMs: 1000 } });
    opened.push(idle, ended);

    // The checkout as an archive, the prompt and the issue's context as files.
    await sb.putArchive(repo, '/workspace/repo');
    const prompt = 'Fix the issue: add() must also subtract.\n';
    const context = JSON.stringify({ issue: 34, title: 'add subtracts', comments: [] });
    await sb.writeFile('/workspace/.vantik/prompt.md', prompt);
    await sb.writeFile('/workspace/.vantik/issue.json', context);
    assert.equal((await sb.readFile('/workspace/.vantik/prompt.md')).toString(), prompt);

    // Commands in the guest, output streamed.
    const clean = await run(sb, 'git status --porcelain && git log --oneline | wc -l');
    assert.equal(clean.code, 0, clean.out);
    assert.equal(clean.out.trim(), '1', `a clean checkout with its one commit: ${clean.out}`);
    const tests = await run(sb, 'node --test 2>&1');
    assert.equal(tests.code, 0, tests.out);
    assert.match(tests.out, /pass 1/);
    const placeholder = await run(sb, 'echo "$ANTHROPIC_API_KEY $CI"');
    assert.match(placeholder.out, /^vantik-placeholder-[0-9a-f]{32} 1\n$/, 'the key never enters the guest');

    // The agent's work: change, add, remove; git sees it, and a watch of the checkout (issue 35)
    // sees each change as it happens.
    const events = await sb.watch('/workspace/repo', { recursive: true, timeoutMs: 60_000 });
    const ready = await events.next();
    assert.equal(ready.value?.event, 'ready', JSON.stringify(ready.value));
    const change = await run(sb, "sed -i 's/a + b/a - -b/' src/add.mjs && echo new > NEW.txt && rm README.md && git status --porcelain");
    assert.equal(change.code, 0, change.out);
    const seen: string[] = [];
    for await (const e of events) {
      if (e.event === 'create' || e.event === 'delete') seen.push(`${e.event} ${e.path}`);
      if (seen.includes('delete /workspace/repo/README.md')) break;
    }
    assert.ok(seen.includes('create /workspace/repo/NEW.txt'), seen.join('\n'));
    assert.deepEqual(change.out.trimEnd().split('\n').sort(), [' D README.md', ' M src/add.mjs', '?? NEW.txt']);

    // A person looks in through a terminal (issue 35): the guest image's login shell, its size
    // following a resize, its exit status at the end; a refused size is the host's error.
    const term = await sb.terminal({ rows: 30, cols: 90 });
    let screen = '';
    const readUntil = async (want: string) => {
      for await (const chunk of term) {
        screen += Buffer.from(chunk).toString('utf8');
        if (screen.includes(want)) return;
      }
      assert.fail(`the terminal ended before ${want}: ${screen}`);
    };
    term.write('stty size; echo at-$((4*4))\r');
    await readUntil('at-16');
    assert.match(screen, /30 90/);
    term.resize(50, 132);
    term.write('cd /workspace/repo && stty size && git status --porcelain | wc -l; echo at-$((4*5))\r');
    await readUntil('at-20');
    assert.match(screen, /50 132/);
    term.write('exit 3\r');
    const termEnd = await term.exited;
    assert.equal(termEnd.exit_code, 3, JSON.stringify(termEnd));
    await assert.rejects(sb.terminal({ rows: 0 }), (e: Error) => /rows must be 1 to 4096/.test(e.message));

    // The run's dev server, for a person's browser: a signed link without the token (issue 35).
    const served = await run(
      sb,
      'cd /workspace/repo && (setsid python3 -m http.server 8000 --bind 127.0.0.1 > /tmp/http.log 2>&1 &) && ' +
        'for i in $(seq 1 100); do curl -sf -o /dev/null http://127.0.0.1:8000/ && exit 0; sleep 0.2; done; exit 1',
    );
    assert.equal(served.code, 0, served.out);
    const link = await sb.portUrl(8000, { ttlS: 120 });
    assert.ok(Date.parse(link.expires_at) > Date.now(), JSON.stringify(link));
    const page = await new Promise<string>((resolve, reject) => {
      http.get(`${link.url}src/add.mjs`, (res) => {
        let text = '';
        res.setEncoding('utf8');
        res.on('data', (c: string) => (text += c));
        res.on('end', () => (res.statusCode === 200 ? resolve(text) : reject(new Error(`${res.statusCode}: ${text}`))));
      }).on('error', reject);
    });
    assert.match(page, /export const add/);

    // Two approaches from here (issue 35): a fork whose child has the repository, the running
    // http.server (its port answers in the child) and a random generator of its own.
    const forked = await sb.fork([{ run_id: 'run-flow-b', time_limit_ms: 600_000, env: { APPROACH: 'b' } }]);
    assert.equal(forked.children.length, 1);
    const child = forked.children[0]!;
    opened.push(child);
    assert.equal(child.created?.started_from, 'fork');
    const inChild = await run(child, 'cd /workspace/repo && git status --porcelain | wc -l && curl -sf http://127.0.0.1:8000/src/add.mjs | head -1 && echo "$APPROACH" && head -c 16 /dev/urandom | od -An -tx1');
    const inParent = await run(sb, 'head -c 16 /dev/urandom | od -An -tx1; echo "${APPROACH:-none}"');
    assert.equal(inChild.code, 0, inChild.out);
    const [changed, first, approach, random] = inChild.out.trim().split('\n');
    assert.equal(changed?.trim(), '3', inChild.out);
    assert.match(first ?? '', /export const add/);
    assert.equal(approach, 'b');
    assert.notEqual(random, inParent.out.trim().split('\n')[0], 'the child reads its own random bytes');
    assert.equal(inParent.out.trim().split('\n')[1], 'none', 'the child\'s env is its own');
    assert.equal(await child.dispose(), true);

    // A refused name, counted.
    const curl = await run(sb, 'curl -sS --max-time 10 https://example.com/ 2>&1; echo "rc=$?"');
    assert.doesNotMatch(curl.out, /rc=0/);

    // An idle gap longer than SANDBOX_HOST_IDLE_MS: the loop holds `sb` (and `ended`); `idle` goes.
    // `idle`'s server stops keeping it alive (its last request now); `sb` and `ended` keep theirs.
    idle.stopKeepalive();
    await idle.keepalive();
    const sentBefore = sb.keepaliveLoop!.sent;
    const gapStart = Date.now();
    let idleGoneAfter: number | undefined;
    while (Date.now() - gapStart < IDLE_MS + 3000) {
      await sleep(500);
      if (idleGoneAfter === undefined && !(await client.list()).some((s) => s.id === idle.id)) idleGoneAfter = Date.now() - gapStart;
    }
    assert.ok(idleGoneAfter !== undefined, 'the sandbox without keepalives was disposed of in the gap');
    assert.ok(idleGoneAfter >= IDLE_MS - 1000, `disposed of ${idleGoneAfter} ms after its last request, not before SANDBOX_HOST_IDLE_MS`);
    process.stderr.write(`# the sandbox without keepalives went ${idleGoneAfter} ms after its last request; the one with them sent ${sb.keepaliveLoop!.sent - sentBefore} in the gap\n`);
    await assert.rejects(idle.keepalive(), NoSandboxError);
    assert.ok(sb.keepaliveLoop!.sent - sentBefore >= 5, `keepalives sent in the gap: ${sb.keepaliveLoop!.sent - sentBefore}`);
    assert.deepEqual(keepaliveErrors, []);
    assert.equal((await run(sb, 'true')).code, 0, 'the kept sandbox still runs commands');

    // The tree read back equals what the commands changed, done here to the checkout.
    const back = join(work, 'back');
    await sb.getArchive('/workspace/repo', back);
    const expected = join(work, 'expected');
    await cp(repo, expected, { recursive: true });
    await writeFile(join(expected, 'src/add.mjs'), 'export const add = (a, b) => a - -b;\n');
    await writeFile(join(expected, 'NEW.txt'), 'new\n');
    await unlink(join(expected, 'README.md'));
    assert.deepEqual(await files(back), await files(expected));
    assert.deepEqual((await git(back, 'status', '--porcelain')).trimEnd().split('\n').sort(), [' D README.md', ' M src/add.mjs', '?? NEW.txt']);

    // Usage and refusals.
    const usage = await sb.usage();
    assert.equal(usage.totals.calls, 0);
    const egress = await sb.egress();
    assert.ok((egress.by_reason.name_not_allowed ?? 0) >= 1, JSON.stringify(egress.by_reason));
    assert.ok(egress.events.some((e) => e.target.startsWith('example.com')), JSON.stringify(egress.events));
    const details = (await client.get(sb.id)).details!;
    assert.equal(details.state, 'ready');
    assert.ok(details.execs >= 6);

    // The host's refusals, as the client names them.
    await assert.rejects(sb.readFile('/workspace/nope.txt'), NotFoundError);
    await assert.rejects((await sb.exec(['no-such-program'])).wait(), BadRequestError);
    await assert.rejects(sb.writeFile('/workspace/big.bin', Buffer.alloc(MAX_BODY_MB * 1024 * 1024 + 1)), (e: unknown) => {
      return e instanceof BodyTooLargeError && e.limitBytes === MAX_BODY_MB * 1024 * 1024 && e.limitMb === MAX_BODY_MB;
    });
    async function* stream(): AsyncGenerator<Uint8Array> {
      for (let i = 0; i < MAX_BODY_MB + 2; i++) yield Buffer.alloc(1024 * 1024, i);
    }
    await assert.rejects(sb.writeFile('/workspace/big.bin', stream()), BodyTooLargeError);
    await assert.rejects(new SandboxHost({ url: real.url, token: 'not-the-token-0123456789abcdef' }).list(), TokenRefusedError);
    await assert.rejects(client.sandbox('sbx-nope').keepalive(), NoSandboxError);

    // Pause and resume: the KVM backend pauses; QEMU refuses with 409 conflict.
    if (health.backend === 'kvm') {
      await sb.pause();
      await assert.rejects(sb.exec('true'), PausedError);
      await sleep(2500);
      assert.deepEqual(keepaliveErrors, [], 'the loop skips while paused');
      await sb.resume();
      assert.equal((await run(sb, 'cat NEW.txt')).out, 'new\n');
    } else {
      await assert.rejects(sb.pause(), ConflictError);
    }

    // The server restarts: its old process (and keepalive loops) are gone; the new one knows
    // only that run-flow is still active.
    ended.stopKeepalive();
    const restarted = new SandboxHost({ url: real.url, token: TOKEN });
    const cleanup = await restarted.disposeEnded(['run-flow']);
    assert.deepEqual(cleanup.disposed.map((s) => s.run_id), ['run-ended']);
    assert.deepEqual(cleanup.kept.map((s) => s.run_id), ['run-flow']);
    assert.deepEqual(cleanup.failed, []);

    // Disposed of: the loop stops with it, and the host has nothing left.
    assert.equal(await sb.dispose(), true);
    assert.equal(sb.keepaliveLoop!.running, false);
    assert.deepEqual(await client.list(), []);
  });
});

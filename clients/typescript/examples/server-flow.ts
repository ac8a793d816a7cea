/**
 * The README's example as a program that type-checks with the tests (`npm test` compiles it; it
 * is not run there: test/flow.test.ts runs the same flow against a real host).
 */
import { SandboxHost } from '../src/index.js';

interface Run {
  id: string;
  prompt: string;
  issue: unknown;
  checkoutDir: string;
  resultDir: string;
  workspaceKey: string;
}

export async function runInSandbox(run: Run, activeRunIds: () => Promise<string[]>, signal: AbortSignal): Promise<void> {
  const log = { warn: (o: object, m: string) => console.warn(m, o) };
  // SANDBOX_HOST_URL and SANDBOX_HOST_TOKEN; without either: "No sandbox host is configured".
  const host = SandboxHost.fromEnv();

  // At start-up: dispose of the sandboxes of runs that ended while the server was down.
  const { disposed, failed } = await host.disposeEnded(await activeRunIds());
  void disposed;
  void failed;

  // The delegate control: the host answers, takes the token and can start microVMs, or the
  // error's message is the reason to show.
  await host.ready();

  // A run: its sandbox, with egress and the model key as a secret (the guest sees a placeholder).
  const sandbox = await host.create(
    {
      run_id: run.id,
      time_limit_ms: 3_600_000,
      review: true,
      harness_version: '0.73.1',
      egress: {
        allow: ['registry.npmjs.org'],
        secrets: [{ env: 'ANTHROPIC_API_KEY', value: run.workspaceKey, hosts: ['api.anthropic.com'] }],
        meter: ['api.anthropic.com'],
      },
    },
    // The keepalive loop: one keepalive a minute while the server holds the sandbox.
    { keepalive: { onError: (err, stopped) => log.warn({ err, stopped }, 'keepalive failed') }, signal },
  );
  try {
    // The checkout (fetched by the server; .git included) streamed in as a tar stream, the
    // prompt and the issue's context as files.
    await sandbox.putArchive(run.checkoutDir, '/workspace', { signal });
    await sandbox.writeFile('/workspace/.vantik/prompt.md', run.prompt);
    await sandbox.writeFile('/workspace/.vantik/issue.json', JSON.stringify(run.issue));

    // A command, its output as it happens.
    const execution = await sandbox.exec(['npm', 'test'], { cwd: '/workspace', timeoutMs: 600_000, signal });
    for await (const { stream, data } of execution) {
      (stream === 'stdout' ? process.stdout : process.stderr).write(data);
    }
    const { exit_code, timed_out } = await execution.wait();
    void exit_code;
    void timed_out;

    // The tree back, written into a directory as it arrives; then the server pushes the branch.
    await sandbox.getArchive('/workspace', run.resultDir, { signal });

    // Spend and refusals for the run's page.
    const usage = await sandbox.usage(); // usage.totals.input_tokens, billed_cost_usd, unmetered_calls
    const egress = await sandbox.egress(); // egress.by_reason.name_not_allowed, ...
    void usage.totals.input_tokens;
    void egress.by_reason.name_not_allowed;
  } finally {
    await sandbox.dispose(); // stops the keepalive loop, then the VM
  }
}

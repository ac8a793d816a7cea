/**
 * Archives both ways against a fake archive endpoint that keeps what it is sent: a directory
 * round trip (contents, modes, symbolic links, dotfiles), gzip, streams, a stream the host cuts,
 * and an archive from a hostile guest that tries to write outside the target.
 */
import assert from 'node:assert/strict';
import { createHash } from 'node:crypto';
import { chmod, lstat, mkdir, mkdtemp, readFile, readdir, readlink, rm, symlink, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { PassThrough, Writable } from 'node:stream';
import { after, before, describe, it } from 'node:test';

import { StreamCutError } from '../src/index.js';
import { FakeHost, readAll } from './fake-host.js';

/** Every entry under `dir`: its type, mode and content (or link target), by relative path. */
async function tree(dir: string, base = ''): Promise<Record<string, string>> {
  const out: Record<string, string> = {};
  for (const name of (await readdir(join(dir, base))).sort()) {
    const rel = base === '' ? name : `${base}/${name}`;
    const full = join(dir, rel);
    const st = await lstat(full);
    const mode = (st.mode & 0o777).toString(8);
    if (st.isSymbolicLink()) out[rel] = `link -> ${await readlink(full)}`;
    else if (st.isDirectory()) {
      out[rel] = `dir ${mode}`;
      Object.assign(out, await tree(dir, rel));
    } else out[rel] = `file ${mode} ${createHash('sha256').update(await readFile(full)).digest('hex').slice(0, 16)}`;
  }
  return out;
}

/** One 512-byte ustar header (for archives node-tar would not write: hostile ones). */
function header(name: string, type: '0' | '1' | '2' | '5', size: number, link = ''): Buffer {
  const h = Buffer.alloc(512);
  h.write(name, 0, 100, 'utf8');
  h.write('0000644\0', 100);
  h.write('0000000\0', 108);
  h.write('0000000\0', 116);
  h.write(size.toString(8).padStart(11, '0') + '\0', 124);
  h.write('00000000000\0', 136);
  h.write('        ', 148);
  h.write(type, 156);
  h.write(link, 157, 100, 'utf8');
  h.write('ustar\0', 257);
  h.write('00', 263);
  let sum = 0;
  for (const b of h) sum += b;
  h.write(sum.toString(8).padStart(6, '0') + '\0 ', 148);
  return h;
}

function entry(name: string, content: string): Buffer[] {
  const data = Buffer.from(content);
  const pad = Buffer.alloc((512 - (data.length % 512)) % 512);
  return [header(name, '0', data.length), data, pad];
}

describe('archives', () => {
  let host: FakeHost;
  let work: string;
  /** What the fake guest's /workspace holds: the last archive put there. */
  let stored: Buffer = Buffer.alloc(0);
  let storedType: string | undefined;

  before(async () => {
    work = await mkdtemp(join(tmpdir(), 'sbx-client-'));
    host = await new FakeHost().listen();
    host.on('PUT /v1/sandboxes/sbx-1/archive', async (req, res, url) => {
      assert.equal(url.searchParams.get('path'), '/workspace');
      storedType = req.headers['content-type'];
      stored = await readAll(req);
      res.writeHead(stored.length === 0 ? 400 : 204);
      res.end();
    });
    host.on('GET /v1/sandboxes/sbx-1/archive', async (_req, res, url) => {
      assert.equal(url.searchParams.get('path'), '/workspace');
      res.writeHead(200, { 'content-type': 'application/x-tar' });
      // As the guest produces it: in pieces.
      for (let i = 0; i < stored.length; i += 7000) {
        if (!res.write(stored.subarray(i, i + 7000))) await new Promise((r) => res.once('drain', r));
      }
      res.end();
    });
  });
  after(async () => {
    await host.close();
    await rm(work, { recursive: true, force: true });
  });

  async function checkout(): Promise<string> {
    const dir = join(work, `src-${Math.random().toString(36).slice(2)}`);
    await mkdir(join(dir, '.git/refs/heads'), { recursive: true });
    await mkdir(join(dir, 'src/deep/er'), { recursive: true });
    await mkdir(join(dir, 'empty'));
    await writeFile(join(dir, '.git/HEAD'), 'ref: refs/heads/main\n');
    await writeFile(join(dir, 'README.md'), '# hello\n');
    await writeFile(join(dir, 'src/deep/er/data.bin'), Buffer.from(Array.from({ length: 300_000 }, (_, i) => (i * 7) % 256)));
    await writeFile(join(dir, 'run.sh'), '#!/bin/sh\necho hi\n');
    await chmod(join(dir, 'run.sh'), 0o755);
    await writeFile(join(dir, 'é ü ☃.txt'), 'unicode name\n');
    await symlink('README.md', join(dir, 'link-to-readme'));
    return dir;
  }

  it('a directory goes up as a tar stream and comes back the same', async () => {
    const src = await checkout();
    const sb = host.client().sandbox('sbx-1');
    await sb.putArchive(src);
    assert.equal(storedType, 'application/x-tar');
    const back = join(work, 'back');
    await sb.getArchive('/workspace', back);
    assert.deepEqual(await tree(back), await tree(src));
    assert.ok(Object.keys(await tree(back)).includes('.git/HEAD'));
  });

  it('gzip: sent as application/gzip, its magic bytes first, and extracted the same', async () => {
    const src = await checkout();
    const sb = host.client().sandbox('sbx-1');
    await sb.putArchive(src, '/workspace', { gzip: true });
    assert.equal(storedType, 'application/gzip');
    assert.deepEqual([...stored.subarray(0, 2)], [0x1f, 0x8b]);
    const back = join(work, 'back-gz');
    await sb.getArchive('/workspace', back);
    assert.deepEqual(await tree(back), await tree(src));
  });

  it('streams both ways: a tar stream up, the archive into a writable stream', async () => {
    const body = Buffer.concat([...entry('a.txt', 'from a stream\n'), Buffer.alloc(1024)]);
    const up = new PassThrough();
    const sb = host.client().sandbox('sbx-1');
    const put = sb.putArchive(up);
    up.write(body.subarray(0, 100));
    setTimeout(() => up.end(body.subarray(100)), 10);
    await put;
    assert.deepEqual(stored, body);
    const parts: Buffer[] = [];
    await sb.getArchive(
      '/workspace',
      new Writable({
        write(chunk: Buffer, _enc, cb) {
          parts.push(chunk);
          cb();
        },
      }),
    );
    assert.deepEqual(Buffer.concat(parts), body);
    // A web stream too.
    const web = new ReadableStream<Uint8Array>({
      start(c) {
        c.enqueue(body);
        c.close();
      },
    });
    await sb.putArchive(web);
    assert.deepEqual(stored, body);
  });

  it('an archive stream the host cuts midway is StreamCutError', async () => {
    host.on('GET /v1/sandboxes/sbx-2/archive', async (_req, res) => {
      res.writeHead(200, { 'content-type': 'application/x-tar' });
      res.write(Buffer.concat(entry('first.txt', 'x'.repeat(2000))));
      res.write(header('second.txt', '0', 100_000));
      await new Promise((r) => setTimeout(r, 20));
      res.socket?.destroy();
    });
    await assert.rejects(host.client().sandbox('sbx-2').getArchive('/workspace', join(work, 'cut')), StreamCutError);
  });

  it('an upload aborted midway throws the signal\'s reason, and the source stops being read', async () => {
    let serverSawClose: Promise<boolean> = Promise.resolve(false);
    host.on('PUT /v1/sandboxes/sbx-3/archive', async (req, res) => {
      serverSawClose = new Promise((resolve) => req.on('close', () => resolve(!req.complete)));
      req.resume();
      // Never answers: the client gives up first.
      await new Promise((r) => req.on('close', r));
    });
    const source = new PassThrough();
    source.write(Buffer.alloc(64 * 1024));
    const ac = new AbortController();
    setTimeout(() => ac.abort(), 50);
    await assert.rejects(host.client().sandbox('sbx-3').putArchive(source, '/workspace', { signal: ac.signal }), (e: unknown) => e instanceof DOMException && e.name === 'AbortError');
    assert.equal(await serverSawClose, true, 'the host saw the upload end before its end');
    await new Promise((r) => setTimeout(r, 20));
    assert.equal(source.destroyed, true, 'the source was ended with the request');
  });

  it("a hostile guest's archive writes nothing outside the target", async () => {
    const target = join(work, 'hostile', 'into');
    const outside = join(work, 'hostile');
    stored = Buffer.concat([
      ...entry('../escaped.txt', 'escaped'),
      ...entry('/abs-escaped.txt', 'absolute'),
      header('evil-link', '2', 0, '..'),
      ...entry('evil-link/through-link.txt', 'through a link'),
      header('hard', '1', 0, '/etc/passwd'),
      ...entry('ok.txt', 'fine'),
      Buffer.alloc(1024),
    ]);
    await host.client().sandbox('sbx-1').getArchive('/workspace', target);
    assert.deepEqual((await readdir(outside)).sort(), ['into']);
    const inside = await tree(target);
    assert.equal(inside['ok.txt']?.startsWith('file'), true);
    assert.equal(inside['hard'], undefined, 'no hard link');
    // The absolute name is made relative (tar's own rule), never written at /.
    await assert.rejects(lstat('/abs-escaped.txt'));
  });
});

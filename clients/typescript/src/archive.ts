/**
 * Directories to and from tar streams, streamed both ways with the `tar` package (node-tar, the
 * archiver npm itself uses): a directory is read as it is sent, and an archive is written to
 * disk as it arrives, never held whole in memory.
 *
 * An archive from a guest is untrusted input: it is extracted with no path leaving the target
 * (node-tar strips leading `/` and refuses `..`, and does not write through symbolic links it
 * made), no owners applied (a server running as root would otherwise take the guest's uids),
 * and only regular files, directories and symbolic links.
 */
import { mkdir, readdir } from 'node:fs/promises';
import { Readable, Writable } from 'node:stream';
import type { ReadableStream as WebReadableStream, WritableStream as WebWritableStream } from 'node:stream/web';

import * as tar from 'tar';

/** What can be sent as a request body: a Node stream, a web stream, bytes, or any async iterable of bytes. */
export type ByteSource =
  | Readable
  | WebReadableStream<Uint8Array>
  | AsyncIterable<Uint8Array>
  | Uint8Array
  | string;

/** Where a downloaded stream can go: a Node or a web writable stream. */
export type ByteSink = Writable | WebWritableStream<Uint8Array>;

/** How a directory is packed. */
export interface PackOptions {
  /** gzip the archive (the host recognises it by its magic bytes); default false: on a local link it only costs time. */
  gzip?: boolean | undefined;
  /**
   * Leave out owners, times of access and change, device and inode numbers (default true), so
   * that the guest's files belong to the guest's user, not to the server's uid.
   */
  portable?: boolean | undefined;
  /** Leaves out an entry when it returns false (its path relative to the directory). */
  filter?: ((path: string) => boolean) | undefined;
}

/** A directory as a tar stream, read from disk as the stream is read. Dotfiles (`.git`) included. */
export async function packDirectory(dir: string, options: PackOptions = {}): Promise<Readable> {
  const names = (await readdir(dir)).sort();
  const filter = options.filter;
  const pack = tar.create(
    {
      cwd: dir,
      // A file that cannot be read fails the upload instead of being left out with a warning.
      strict: true,
      gzip: options.gzip ?? false,
      portable: options.portable ?? true,
      ...(filter !== undefined ? { filter: (path: string) => filter(path.replace(/^\.\//, '')) } : {}),
    },
    names,
  );
  // node-tar's streams are Minipass streams; as an async iterable they become a Node Readable
  // that is read only as fast as the request takes it.
  return Readable.from(pack as AsyncIterable<Buffer>, { objectMode: false });
}

/** How an archive is extracted. */
export interface ExtractOptions {
  /** Leading path components to drop from each entry (tar's `--strip-components`). */
  strip?: number | undefined;
}

/** Entry types written to disk; everything else (devices, FIFOs, hard links) is skipped. */
const EXTRACTED_TYPES: ReadonlySet<string> = new Set(['File', 'OldFile', 'ContiguousFile', 'Directory', 'SymbolicLink']);

/**
 * Extracts the tar (or tar.gz) read from `source` into `dir` (created if missing), writing each
 * chunk before the next is read, and resolves once every file is on disk.
 */
export async function extractInto(source: AsyncIterable<Uint8Array>, dir: string, options: ExtractOptions = {}): Promise<void> {
  await mkdir(dir, { recursive: true });
  const unpack = new tar.Unpack({
    cwd: dir,
    strip: options.strip ?? 0,
    preserveOwner: false,
    preservePaths: false,
    filter: (_path, entry) => 'type' in entry && EXTRACTED_TYPES.has(String(entry.type)),
  });
  const done = new Promise<void>((resolve, reject) => {
    unpack.on('error', reject);
    unpack.on('close', () => resolve());
  });
  // A failure while writing is reported by `done`; the loop only stops feeding.
  done.catch(() => undefined);
  let failed = false;
  unpack.once('error', () => {
    failed = true;
  });
  try {
    for await (const chunk of source) {
      if (failed) break;
      if (!unpack.write(Buffer.from(chunk.buffer, chunk.byteOffset, chunk.byteLength))) {
        await new Promise<void>((resolve) => {
          const go = (): void => {
            unpack.off('drain', go);
            unpack.off('error', go);
            resolve();
          };
          unpack.on('drain', go);
          unpack.on('error', go);
        });
      }
    }
  } catch (err) {
    // The source broke off: what was extracted stays, the rest of the archive never comes.
    unpack.abort(err instanceof Error ? err : new Error(String(err)));
    throw err;
  }
  if (!failed) unpack.end();
  await done;
}

/** Any byte source as a Node Readable (read on demand) or, for bytes, the bytes themselves. */
export function toReadable(source: ByteSource): Readable | Uint8Array {
  if (typeof source === 'string') return Buffer.from(source, 'utf8');
  if (source instanceof Uint8Array) return source;
  if (source instanceof Readable) return source;
  if (isWebReadable(source)) return Readable.fromWeb(source);
  return Readable.from(source, { objectMode: false });
}

/** Any sink as a Node Writable. */
export function toWritable(sink: ByteSink): Writable {
  if (sink instanceof Writable) return sink;
  return Writable.fromWeb(sink);
}

function isWebReadable(v: unknown): v is WebReadableStream<Uint8Array> {
  return typeof v === 'object' && v !== null && typeof (v as { getReader?: unknown }).getReader === 'function';
}

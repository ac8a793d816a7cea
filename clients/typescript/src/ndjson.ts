/**
 * Lines of an NDJSON stream, read incrementally: each network chunk is split at its newlines as
 * it arrives, a line cut across chunks is joined when its end comes, and the next chunk is read
 * only when the consumer asks for the next line. Nothing waits for the whole body, so the
 * stream's flow control reaches the producer (for an exec, the command in the guest).
 */

/** The longest line accepted. An exec line holds one base64 chunk of output, far below this. */
export const MAX_LINE_BYTES = 16 * 1024 * 1024;

/**
 * Yields each complete line (without its `\n`, and without a `\r` before it) as bytes. A last
 * line without a newline is yielded too. A line longer than `maxLine` throws a `RangeError`.
 */
export async function* lines(
  source: AsyncIterable<Uint8Array>,
  maxLine: number = MAX_LINE_BYTES,
): AsyncGenerator<Buffer, void, undefined> {
  // The pieces of the line not yet ended, and their total length.
  let pending: Buffer[] = [];
  let pendingSize = 0;
  for await (const piece of source) {
    const chunk = Buffer.isBuffer(piece) ? piece : Buffer.from(piece.buffer, piece.byteOffset, piece.byteLength);
    let start = 0;
    for (;;) {
      const nl = chunk.indexOf(0x0a, start);
      if (nl === -1) break;
      const tail = chunk.subarray(start, nl);
      const line = pending.length === 0 ? tail : Buffer.concat([...pending, tail], pendingSize + tail.length);
      pending = [];
      pendingSize = 0;
      if (line.length > maxLine) throw new RangeError(`an NDJSON line is longer than ${maxLine} bytes`);
      yield trimCr(line);
      start = nl + 1;
    }
    if (start < chunk.length) {
      const rest = chunk.subarray(start);
      pendingSize += rest.length;
      if (pendingSize > maxLine) throw new RangeError(`an NDJSON line is longer than ${maxLine} bytes`);
      pending.push(rest);
    }
  }
  if (pendingSize > 0) yield trimCr(Buffer.concat(pending, pendingSize));
}

function trimCr(line: Buffer): Buffer {
  return line.length > 0 && line[line.length - 1] === 0x0d ? line.subarray(0, -1) : line;
}

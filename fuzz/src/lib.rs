//! What the fuzz targets share: cutting one input into the chunks a stream delivers it in, so
//! a target can check that a reader's answer does not depend on where the network split it.

/// Splits `data` into a chunk plan and the payload: the first byte (if any) seeds the chunk
/// sizes (1 to 64 bytes, or everything at once for seed 0), the rest is the payload.
pub fn split(data: &[u8]) -> (Vec<&[u8]>, &[u8]) {
    let Some((&seed, payload)) = data.split_first() else {
        return (vec![], data);
    };
    if seed == 0 {
        return (vec![payload], payload);
    }
    let mut chunks = vec![];
    let mut rest = payload;
    let mut state = u32::from(seed);
    while !rest.is_empty() {
        // A small linear congruential sequence: deterministic for one input, varied across.
        state = state.wrapping_mul(1_103_515_245).wrapping_add(12_345);
        let n = ((state >> 16) as usize % 64 + 1).min(rest.len());
        let (head, tail) = rest.split_at(n);
        chunks.push(head);
        rest = tail;
    }
    (chunks, payload)
}

/* Prints 64 bytes from getrandom(2) as hex: what Python's os.urandom, Node's crypto and every
 * modern runtime read for randomness. The snapshot tests run it in clones of one snapshot, whose
 * kernels must each have been reseeded (the agent's Identity) before anything reads it. */
#include <stdio.h>
#include <sys/random.h>

int main(void) {
    unsigned char b[64];
    if (getrandom(b, sizeof b, 0) != (ssize_t)sizeof b) {
        perror("getrandom");
        return 1;
    }
    for (unsigned i = 0; i < sizeof b; i++)
        printf("%02x", b[i]);
    printf("\n");
    return 0;
}

// Headers shared by every THC P4 program: Ethernet / IPv4 / UDP in front of the THC header, and the
// one-word payload of the norm stage. The THC header itself (thc_h) and the protocol constants are
// generated from the Python layout into thc_headers.p4. The DATA and RESULT payload headers depend on
// K, b and the result width, so each program declares them (p4src/bmv2/thc.p4 is generated for them).
#ifndef THC_COMMON_P4_
#define THC_COMMON_P4_

#include "thc_headers.p4"

const bit<16> ETHERTYPE_IPV4 = 0x0800;
const bit<8> IPPROTO_UDP = 17;
const bit<16> UDP_HEADER_BYTES = 8;
const bit<16> IPV4_HEADER_BYTES = 20;

typedef bit<48> mac_addr_t;
typedef bit<32> ipv4_addr_t;

header ethernet_h {
    mac_addr_t dstAddr;
    mac_addr_t srcAddr;
    bit<16> etherType;
}

header ipv4_h {
    bit<4> version;
    bit<4> ihl;
    bit<8> diffserv;
    bit<16> totalLen;
    bit<16> identification;
    bit<3> flags;
    bit<13> fragOffset;
    bit<8> ttl;
    bit<8> protocol;
    bit<16> hdrChecksum;
    ipv4_addr_t srcAddr;
    ipv4_addr_t dstAddr;
}

header udp_h {
    bit<16> srcPort;
    bit<16> dstPort;
    bit<16> length;
    bit<16> checksum;
}

// NORM / NORM_RESULT payload: IEEE-754 binary32 bits of a non-negative finite norm, big-endian.
header thc_norm_h {
    bit<32> value;
}

#endif  // THC_COMMON_P4_

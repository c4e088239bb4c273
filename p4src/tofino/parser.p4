// TNA parsers and deparsers of the THC Tofino program (included by p4src/tofino/thc.p4).
//
// Why a Tofino-specific file: a TNA ingress parser must first take the intrinsic metadata and skip the
// port metadata, and this program carries a bridge header in front of
// Ethernet, from ingress to egress and, for recirculated packets, from pass 1 to pass 2. After that
// prefix the ingress parser runs the shared ThcHeaderParser (p4src/include/thc_parser.p4), so the THC
// header and payloads are parsed exactly as on BMv2; the egress parser stops after the THC header.
#ifndef THC_TOFINO_PARSER_P4_
#define THC_TOFINO_PARSER_P4_

#include "thc_parser.p4"

parser ThcIngressParser(packet_in pkt, out thc_headers_t hdr, out thc_metadata_t meta,
                        out ingress_intrinsic_metadata_t ig_intr_md) {
    ThcHeaderParser() thc_parser;

    state start {
        pkt.extract(ig_intr_md);
        pkt.advance(PORT_METADATA_SIZE);
#ifdef THC_LEAF
        meta = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}};
#else
        meta = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
#endif
        transition select(ig_intr_md.ingress_port) {
            THC_RECIRC_PORT: parse_bridge;   // pass 2: the bridge header written by pass 1
            default: parse_packet;
        }
    }
    state parse_bridge {
        pkt.extract(hdr.bridge);
        transition parse_packet;
    }
    state parse_packet {
#ifdef THC_PARSE_RESULTS
        thc_parser.apply(pkt, hdr.ethernet, hdr.ipv4, hdr.udp, hdr.thc, hdr.data, hdr.norm, hdr.result);
#else
        thc_parser.apply(pkt, hdr.ethernet, hdr.ipv4, hdr.udp, hdr.thc, hdr.data, hdr.norm);
#endif
        transition accept;
    }
}

control ThcIngressDeparser(packet_out pkt, inout thc_headers_t hdr, in thc_metadata_t meta,
                           in ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md) {
    apply {
        pkt.emit(hdr);
    }
}

// Egress reads and rewrites only Ethernet, IPv4, UDP and the THC header (addresses of multicast
// replicas, learnt sender addresses) and removes the bridge header; the payload (DATA
// indices, norm, RESULT sums) passes through unparsed. Parsing it too made the longest egress path 180
// bytes, over Tofino 1's 160-byte parse depth (bf-p4c: "exceeds maximum parse depth").
parser ThcEgressParser(packet_in pkt, out thc_headers_t hdr, out thc_egress_metadata_t meta,
                       out egress_intrinsic_metadata_t eg_intr_md) {
    state start {
        pkt.extract(eg_intr_md);
        meta = {0, 0, 0, 0, 0, 0, 0};
        pkt.extract(hdr.bridge);   // every packet carries one from ingress
        transition parse_packet;
    }
    state parse_packet {
        pkt.extract(hdr.ethernet);
        transition select(hdr.ethernet.etherType) {
            ETHERTYPE_IPV4: parse_ipv4;
            default: accept;
        }
    }
    state parse_ipv4 {
        pkt.extract(hdr.ipv4);
        transition select(hdr.ipv4.ihl, hdr.ipv4.fragOffset, hdr.ipv4.protocol) {
            (5, 0, IPPROTO_UDP): parse_udp;
            default: accept;
        }
    }
    state parse_udp {
        pkt.extract(hdr.udp);
        transition select(hdr.udp.dstPort) {
            THC_UDP_PORT: parse_thc;
            default: accept;
        }
    }
    state parse_thc {
        pkt.extract(hdr.thc);
        transition accept;
    }
}

control ThcEgressDeparser(packet_out pkt, inout thc_headers_t hdr, in thc_egress_metadata_t meta,
                          in egress_intrinsic_metadata_for_deparser_t eg_dprsr_md) {
    Checksum() ipv4_checksum;

    apply {
        if (hdr.ipv4.isValid()) {
            hdr.ipv4.hdrChecksum = ipv4_checksum.update({
                hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.diffserv, hdr.ipv4.totalLen, hdr.ipv4.identification,
                hdr.ipv4.flags, hdr.ipv4.fragOffset, hdr.ipv4.ttl, hdr.ipv4.protocol, hdr.ipv4.srcAddr,
                hdr.ipv4.dstAddr});
        }
        pkt.emit(hdr);
    }
}

#endif  // THC_TOFINO_PARSER_P4_

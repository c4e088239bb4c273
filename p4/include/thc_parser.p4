// The THC parser, shared by the THC programs. It expects the including program to define
//   struct thc_headers_t { ethernet_h ethernet; ipv4_h ipv4; udp_h udp; thc_h thc;
//                          thc_data_h data; thc_norm_h norm; ... }
// where thc_data_h is the program's K x b-bit DATA payload.
//
// Ethernet -> IPv4 (no options, not a fragment) -> UDP -> if the destination port is THC_UDP_PORT:
// the THC header, then the DATA payload for version-1 DATA packets or the norm word for version-1 NORM
// packets. Anything else is accepted as parsed so far (plain IPv4 forwarding). A THC packet shorter
// than what it announces stops the parser with PacketTooShort; v1model then runs the ingress with the
// headers parsed so far, which validates the packet (counter short or bad_format) exactly as the
// Python aggregator does.
#ifndef THC_PARSER_P4_
#define THC_PARSER_P4_

#include "thc_common.p4"

parser ThcHeaderParser(packet_in pkt, out thc_headers_t hdr) {
    state start {
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
        transition select(hdr.thc.version, hdr.thc.type_) {
            (THC_VERSION, THC_TYPE_DATA): parse_data;
            (THC_VERSION, THC_TYPE_NORM): parse_norm;
            default: accept;
        }
    }
    state parse_data {
        pkt.extract(hdr.data);
        transition accept;
    }
    state parse_norm {
        pkt.extract(hdr.norm);
        transition accept;
    }
}

#endif  // THC_PARSER_P4_

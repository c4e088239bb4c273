// The THC parser, shared by the THC programs. It takes the headers it extracts one by one (not the
// program's whole header struct: the Tofino program has extracted its bridge header into that struct
// before it, and an out struct would reset it). thc_data_h is the program's K x b-bit DATA payload.
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

parser ThcHeaderParser(packet_in pkt, out ethernet_h ethernet, out ipv4_h ipv4, out udp_h udp, out thc_h thc,
                       out thc_data_h data, out thc_norm_h norm
#ifdef THC_PARSE_RESULTS
                       , out thc_result_h result
#endif
                       ) {
    state start {
        pkt.extract(ethernet);
        transition select(ethernet.etherType) {
            ETHERTYPE_IPV4: parse_ipv4;
            default: accept;
        }
    }
    state parse_ipv4 {
        pkt.extract(ipv4);
        transition select(ipv4.ihl, ipv4.fragOffset, ipv4.protocol) {
            (5, 0, IPPROTO_UDP): parse_udp;
            default: accept;
        }
    }
    state parse_udp {
        pkt.extract(udp);
        transition select(udp.dstPort) {
            THC_UDP_PORT: parse_thc;
            default: accept;
        }
    }
    state parse_thc {
        pkt.extract(thc);
        transition select(thc.version, thc.type_) {
            (THC_VERSION, THC_TYPE_DATA): parse_data;
            (THC_VERSION, THC_TYPE_NORM): parse_norm;
#ifdef THC_PARSE_RESULTS
            // A program that receives results (a Tofino leaf: its parent's answers) parses them too.
            (THC_VERSION, THC_TYPE_RESULT): parse_result;
            (THC_VERSION, THC_TYPE_NORM_RESULT): parse_norm;
#endif
            default: accept;
        }
    }
#ifdef THC_PARSE_RESULTS
    state parse_result {
        pkt.extract(result);
        transition accept;
    }
#endif
    state parse_data {
        pkt.extract(data);
        transition accept;
    }
    state parse_norm {
        pkt.extract(norm);
        transition accept;
    }
}

#endif  // THC_PARSER_P4_
